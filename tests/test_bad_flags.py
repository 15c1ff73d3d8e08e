"""Bad command-line values of train, sweep, experiments and the dashboard: one UserError naming the value, raised
before any folder, database or server exists."""
import shutil
import socket
from pathlib import Path

import pytest
import torch

from domino_lab.errors import UserError
from domino_lab.models.drafter import SHIPPED_DRAFTERS

SHIPPED_DRAFTER = SHIPPED_DRAFTERS["default"]


def _nothing_in(folder: Path) -> bool:
    return not folder.exists() or not any(folder.iterdir())


# ---------------------------------------------------------------------------------------------- train
@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)


@pytest.mark.parametrize("flags, match", [
    (["accelerator=gpu"], "accelerator=gpu: no GPU is available"),
    (["--accelerator", "cuda"], "accelerator=cuda: no GPU is available"),
    (["--accelerator", "tpu"], "accelerator must be one of"),
    (["--strategy", "bogus"], "strategy must be 'auto' or a strategy Lightning knows"),
    (["--strategy", "fsdp"], "strategy=fsdp needs CUDA GPUs"),
    (["--strategy", "xla"], "runs on TPUs"),
    (["--devices", "abc"], "devices must be a number of devices"),
    (["--devices", "0"], "devices must be a number of devices"),
    (["--devices", "-2"], "devices must be a number of devices"),
    (["--devices", "0,1"], "names GPUs, but training runs on the CPU"),
    (["--devices", "-1"], "names GPUs, but training runs on the CPU"),
])
def test_train_rejects_bad_trainer_flags_before_creating_anything(tmp_path, no_gpu, flags, match):
    from domino_lab.train import main

    work = tmp_path / "x"
    argv = ["--config", "experiments/configs/domino.yaml", "data.path=runs/regenerated/sweep-default",
            f"tracking_uri=sqlite:///{work}/ml.db", f"out_dir={work}/tr", "max_steps=1", *flags]
    with pytest.raises(UserError, match=match):
        main(argv)
    assert not work.exists()


def test_trainer_flags_lightning_takes_pass(no_gpu):
    from domino_lab.training.config import TrainConfig

    for kw in ({"accelerator": "cpu", "devices": 2, "strategy": "ddp"}, {"devices": "auto"},
               {"devices": "1", "strategy": "DDP"}, {"accelerator": "auto", "strategy": "auto"}):
        TrainConfig(**kw)


def test_gpu_devices_are_checked_against_the_gpus_there(monkeypatch):
    from domino_lab.training.devices import check_devices

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_devices("0,1", "cuda", "gpu")
    check_devices(-1, "cuda", "gpu")
    with pytest.raises(UserError, match="has 2 GPU"):
        check_devices("1,2", "cuda", "gpu")
    with pytest.raises(UserError, match="give at most 2"):
        check_devices(3, "cuda", "gpu")


# ---------------------------------------------------------------------------------------------- sweep
@pytest.mark.parametrize("flags, match", [
    (["--threads", "-1"], "--threads must be a whole number between 1 and 4096"),
    (["--threads", "0"], "--threads must be a whole number between 1 and 4096"),
    (["--threads", "99999999999999999999999"], "--threads must be a whole number between 1 and 4096"),
    (["--timeout", "-5"], r"timeout_min \(--timeout\) must be a number of minutes > 0.*leave it out for no limit"),
    (["--timeout", "0"], r"timeout_min \(--timeout\) must be a number of minutes > 0"),
    (["timeout_min=0"], r"timeout_min \(--timeout\) must be a number of minutes > 0"),
])
def test_sweep_rejects_bad_threads_and_timeout(tmp_path, flags, match):
    from domino_lab.sweep.__main__ import main

    runs = tmp_path / "x"
    with pytest.raises(UserError, match=match):
        main(["--runs-dir", str(runs), "--prepare-only", *flags])
    assert not runs.exists()


# ---------------------------------------------------------------------------------------------- experiments
@pytest.mark.parametrize("flags, match", [
    (["max_steps=abc", "--quick"], "max_steps: expected int, got 'abc'"),
    (["data.batch_size=-4", "--quick"], "data.batch_size must be a whole number >= 1"),
    (["--quick", "--threads", "-1"], "--threads must be a whole number between 1 and 4096"),
    (["--quick", "--threads", "0"], "--threads must be a whole number between 1 and 4096"),
    (["--quick", "--threads", "99999999999999999999999"], "--threads must be a whole number between 1 and 4096"),
    (["--quick", "data.path=/nonexistent/data"], "--quick with data.path: /nonexistent/data does not exist"),
    (["target=/nonexistent/model"], "target '/nonexistent/model' is not a model directory"),
])
def test_experiments_reject_bad_values_before_training(tmp_path, flags, match):
    from domino_lab.experiments.__main__ import main

    runs, out = tmp_path / "runs", tmp_path / "out"
    with pytest.raises(UserError, match=match):
        main(["run", "block_size", "--runs-dir", str(runs), "--out-dir", str(out), *flags])
    assert _nothing_in(runs) and not out.exists()


def test_experiments_overrides_may_follow_options_and_win_over_quick(tmp_path):
    from domino_lab.experiments.__main__ import parse_args
    from domino_lab.experiments.spec import load_spec
    from domino_lab.experiments.training import resolve_runs

    args = parse_args(["run", "block_size", "--runs-dir", str(tmp_path), "target=default", "--quick",
                       "max_steps=2"])
    assert args.cmd == "run" and args.name == "block_size" and args.quick
    assert args.overrides == ["target=default", "max_steps=2"]
    resolved = resolve_runs(load_spec("block_size"), tmp_path, True, extra=args.overrides)
    assert {cfg.max_steps for _, _, cfg, _ in resolved} == {2}                 # the user's value, not --quick's 4
    assert {cfg.data.batch_size for _, _, cfg, _ in resolved} == {2}           # --quick fills in the rest
    assert _nothing_in(tmp_path)


def test_experiments_out_dir_is_checked_without_creating_it(tmp_path):
    from domino_lab.experiments.__main__ import check_writable

    (tmp_path / "a-file").write_text("x")
    with pytest.raises(UserError, match="--out-dir .*a-file.*goes through .*a-file, which is a file, not a folder"):
        check_writable(tmp_path / "a-file" / "results")
    check_writable(tmp_path / "new" / "results")
    assert not (tmp_path / "new").exists()


# ---------------------------------------------------------------------------------------------- dashboard
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _validate(*flags):
    from app.main import parse_args, validate_args

    return validate_args(parse_args(["--port", str(_free_port()), *flags]))


@pytest.fixture
def truncated_drafter(tmp_path):
    d = tmp_path / "drafter"
    shutil.copytree(SHIPPED_DRAFTER, d)
    weights = d / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    return d


def test_app_port_in_use_is_one_error():
    from app.main import parse_args, validate_args

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(UserError, match=f"--port {port} is already in use"):
            validate_args(parse_args(["--port", str(port)]))


@pytest.mark.parametrize("flags, match", [
    (["--host", "999.1.1.1"], "--host 999.1.1.1 is not an address or a host name"),
    (["--target", "/nonexistent"], "target '/nonexistent' is not a model directory"),
    (["--tracking-uri", "bogus://x"], "MLflow has no store for 'bogus'"),
    (["--max-queue", "-1"], "--max-queue must be a whole number >= 1"),
    (["--max-queue", "0"], "--max-queue must be a whole number >= 1"),
    (["--concurrency", "0"], "--concurrency must be a whole number >= 1"),
    (["--threads", "99999999999999999999999"], "--threads must be a whole number between 1 and 4096"),
    (["--runs-dir", __file__], "--runs-dir .* is a file, not a folder"),
])
def test_app_rejects_bad_launch_arguments(flags, match):
    with pytest.raises(UserError, match=match):
        _validate(*flags)


def test_app_rejects_a_truncated_drafter(truncated_drafter):
    with pytest.raises(UserError, match=f"--drafter {truncated_drafter}: drafter weights .* are cut off"):
        _validate("--drafter", str(truncated_drafter))


def test_app_accepts_good_launch_arguments():
    assert _validate("--drafter", str(SHIPPED_DRAFTER), "--max-queue", "1") == {}


# ---------------------------------------------------------------------------------------------- flags that would be ignored
@pytest.mark.parametrize("flags, match", [
    (["--tree-sampled", "--temperature", "1"], "--tree-sampled shapes a draft tree.*add --tree-nodes"),
    (["--tree-min-prob", "0.1"], "--tree-min-prob shapes a draft tree"),
    (["--steps"], "--steps adds the per-step records to the JSON output: add --json"),
])
def test_generate_refuses_flags_it_would_ignore(flags, match, monkeypatch):
    from domino_lab import generate

    # refused before any model loads
    monkeypatch.setattr("domino_lab.Target.from_pretrained", lambda *a, **k: pytest.fail("loaded a target"))
    with pytest.raises(UserError, match=match):
        generate.main(["--prompt", "def f(x):", "--max-new-tokens", "4", *flags])


def test_batched_inference_refuses_one_sequence_options(tmp_path):
    from domino_lab.inference import main

    for flag in (["--adaptive-drafts"], ["--tree-sampled"]):
        with pytest.raises(UserError, match="one-sequence option|shapes a draft tree"):
            main(["--prompts", "math", "--limit", "1", "--max-new-tokens", "4", "--batched", *flag,
                  "--out", str(tmp_path / "o.jsonl")])
    assert not (tmp_path / "o.jsonl").exists()


def test_bench_drafter_options_name_the_key_of_the_wrong_type():
    from domino_lab.models.options import with_options
    from domino_lab.models import InferenceOptions

    for text, match in (("block_size=abc", "block_size must be an int, got 'abc'"),
                        ("draft_cutoff=abc", "draft_cutoff must be a float"),
                        ("full_vocab=3", "full_vocab must be a bool"), ("lookup=true", "lookup must be an int")):
        with pytest.raises(UserError, match=match):
            with_options(InferenceOptions(), text, "x=default@" + text)
    assert with_options(InferenceOptions(), "draft_cutoff=0,block_size=4", "x").draft_cutoff == 0.0


def test_drafter_items_are_parsed_in_one_place_and_checked_before_anything_loads():
    """Every script's LABEL=SPEC[:head-off][@key=value,...] items go through one parser: labels of their own, the
    options over the caller's base, :head-off kept for loading and provenance."""
    from dataclasses import replace

    from domino_lab.models import InferenceOptions
    from domino_lab.models.options import drafter_items

    base = replace(InferenceOptions(), lookup=3)
    a, b = drafter_items(["off=default:head-off@candidate_pool=16,full_vocab=true", "plain=default-dflash"], base)
    assert (a.label, a.path, a.keys, a.describe()) == ("off", "default", ["candidate_pool", "full_vocab"],
                                                       "default:head-off@candidate_pool=16,full_vocab=true")
    assert (a.options.candidate_pool, a.options.full_vocab, a.options.lookup) == (16, True, 3)
    assert (b.path, b.keys, b.describe(), b.options) == ("default-dflash", [], "default-dflash", base)
    for items, reserved, match in ((["default"], (), "must be LABEL=SPEC"), (["x="], (), "must be LABEL=SPEC"),
                                   (["=default"], (), "must be LABEL=SPEC"),
                                   (["x=default", "x=default-dflash"], (), "different labels"),
                                   (["ar=default"], ("ar",), r"none of \['ar'\]"),
                                   (["x=default@pool=3"], (), "key=value with key one of")):
        with pytest.raises(UserError, match=match):
            drafter_items(items, reserved=reserved)


def test_spawned_strategies_are_refused():
    # spawned processes get a pickled target whose forward returns no hidden states (a crash mid-run otherwise)
    from domino_lab.inference import main
    from domino_lab.training.devices import check_strategy

    for name in ("ddp_spawn", "ddp_notebook"):
        with pytest.raises(UserError, match="starts processes by spawning"):
            check_strategy(name, "cpu")
        with pytest.raises(UserError, match=f"--strategy {name} starts processes by spawning"):
            main(["--prompts", "math", "--limit", "1", "--strategy", name, "--out", "/tmp/never-written.jsonl"])
    check_strategy("ddp", "cpu")


def test_untrained_specs_take_lists_and_exponents():
    from domino_lab import Target
    from domino_lab.models import load_drafter

    target = Target.from_pretrained("default")
    d = load_drafter("untrained:domino:target_layer_ids=[1,3],block_size=4,rms_norm_eps=1e-5", target)
    assert (d.config.target_layer_ids, d.config.block_size, d.config.rms_norm_eps) == ([1, 3], 4, 1e-5)
    with pytest.raises(UserError, match=r"the value of target_layer_ids \('\[1'\) is not a number, word or \[list\]"):
        load_drafter("untrained:domino:target_layer_ids=[1", target)
