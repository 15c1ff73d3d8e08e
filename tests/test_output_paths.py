"""Where results go: every CLI and experiment script refuses an output path it could not write (or must not
replace) when it reads its arguments, with one UserError, before any model loads or any measurement runs."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from core_helpers import experiment_script
from domino_lab.errors import UserError, check_out_dir, check_out_file

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "experiments" / "configs" / "target.yaml"
NO_PROC = not Path("/proc").is_dir()


@pytest.fixture
def a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("keep me")
    return f


@pytest.fixture
def no_models(monkeypatch):
    """Loading a target fails the test: a bad argument must be refused before any model loads."""
    from domino_lab.target import Target

    def refuse(*_, **__):
        raise AssertionError("a model was loaded before the bad argument was refused")

    monkeypatch.setattr(Target, "from_pretrained", refuse)


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# --- the shared helpers ---------------------------------------------------------------------------------------------


def test_out_dir_that_is_a_file(a_file):
    with pytest.raises(UserError, match="is a file, not a folder"):
        check_out_dir(a_file)
    with pytest.raises(UserError, match=f"goes through {a_file}"):
        check_out_dir(a_file / "sub" / "deeper")
    assert a_file.read_text() == "keep me"


@pytest.mark.skipif(NO_PROC, reason="needs /proc")
def test_out_dir_under_proc():
    with pytest.raises(UserError, match=r"--out /proc/x: cannot create anything in /proc.*writable"):
        check_out_dir("/proc/x")
    with pytest.raises(UserError, match="--runs-dir"):
        check_out_dir("/proc/x/y", "--runs-dir")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_out_dir_in_an_unwritable_folder(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        with pytest.raises(UserError, match="cannot create anything in"):
            check_out_dir(locked / "new" / "out")
    finally:
        locked.chmod(0o700)
    assert _leftovers(locked) == []


def test_out_dir_when_the_folder_refuses_writes(tmp_path, monkeypatch):
    """What a read-only mount or an unwritable folder does (also as root, where permission bits do not hold)."""
    import domino_lab.errors as errors

    def refuse(*_, **__):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(errors.tempfile, "mkdtemp", refuse)
    with pytest.raises(UserError, match=r"cannot create anything in .*\(Permission denied\); choose a writable"):
        check_out_dir(tmp_path / "new")


def test_out_dir_new_nested_path_is_fine_and_nothing_is_created(tmp_path):
    target = tmp_path / "a" / "b" / "c"
    assert check_out_dir(target) == target
    assert check_out_dir(tmp_path) == tmp_path                   # an existing folder
    assert _leftovers(tmp_path) == []                            # only checked: no folder, no probe left behind


def test_out_file(tmp_path, a_file):
    assert check_out_file(tmp_path / "new" / "o.jsonl") == tmp_path / "new" / "o.jsonl"
    assert check_out_file(a_file) == a_file                      # an existing file is replaced when written
    with pytest.raises(UserError, match="is a folder"):
        check_out_file(tmp_path)
    with pytest.raises(UserError, match="goes through"):
        check_out_file(a_file / "o.jsonl")
    with pytest.raises(UserError, match="empty"):
        check_out_file("")
    with pytest.raises(UserError, match="empty"):
        check_out_dir(" ")


# --- pretrain ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def no_training(monkeypatch):
    import domino_lab.pretrain.train as pretrain_train

    def refuse(*_, **__):
        raise AssertionError("training started before the bad output was refused")

    monkeypatch.setattr(pretrain_train, "train", refuse)


def test_pretrain_refuses_a_folder_it_did_not_write(tmp_path, no_training):
    from domino_lab.pretrain.__main__ import main

    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("precious")
    with pytest.raises(UserError, match="exists and is not an earlier pretrain output"):
        main(["--config", str(RECIPE), "--quick", "--out", str(out), "--cache-dir", str(tmp_path / "cache")])
    assert (out / "notes.txt").read_text() == "precious"
    assert _leftovers(tmp_path) == ["mine"]                      # no .mine-runs/, no cache, no temp folder


def test_pretrain_refuses_a_regular_file(tmp_path, a_file, no_training):
    from domino_lab.pretrain.__main__ import main

    with pytest.raises(UserError, match="is a file, not a folder"):
        main(["--config", str(RECIPE), "--quick", "--out", str(a_file), "--cache-dir", str(tmp_path / "cache")])
    assert a_file.read_text() == "keep me"
    assert _leftovers(tmp_path) == ["afile"]


@pytest.mark.skipif(NO_PROC, reason="needs /proc")
@pytest.mark.parametrize("flag", ["--out", "--runs-dir"])
def test_pretrain_unwritable_out_or_runs_dir(tmp_path, flag, no_training):
    from domino_lab.pretrain.__main__ import main

    other = ["--runs-dir", str(tmp_path / "runs")] if flag == "--out" else ["--out", str(tmp_path / "o")]
    with pytest.raises(UserError, match=f"{flag} /proc/x: cannot create anything"):
        main(["--config", str(RECIPE), "--quick", flag, "/proc/x", *other, "--cache-dir", str(tmp_path / "c")])
    assert _leftovers(tmp_path) == []


def test_pretrain_output_may_be_replaced_when_empty_or_an_earlier_output(tmp_path):
    from domino_lab.pretrain.train import check_export_dir

    empty = tmp_path / "empty"
    empty.mkdir()
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    for name in ("config.json", "train_meta.json", "model.safetensors"):
        (earlier / name).write_text("{}")
    assert check_export_dir(empty) == empty
    assert check_export_dir(earlier) == earlier
    assert check_export_dir(tmp_path / "new") == tmp_path / "new"


# --- inference --------------------------------------------------------------------------------------------------------

INFER = ["--prompts", "math", "--limit", "2", "--max-new-tokens", "8"]


def _bad_out_cases(tmp_path, a_file):
    cases = [(str(tmp_path), "is a folder"), (str(a_file / "o.jsonl"), "goes through"), ("", "empty")]
    if not NO_PROC:
        cases.append(("/proc/x/o.jsonl", "cannot create anything in /proc"))
    return cases


def test_inference_refuses_bad_out_before_loading(tmp_path, a_file, no_models):
    from domino_lab.inference import main

    for out, why in _bad_out_cases(tmp_path, a_file):
        with pytest.raises(UserError, match=why):
            main([*INFER, "--out", out])
    assert a_file.read_text() == "keep me"


@pytest.mark.parametrize("slots", ["0", "-1"])
def test_inference_slots_below_one(tmp_path, slots, no_models):
    from domino_lab.inference import main

    with pytest.raises(UserError, match=r"slots must be a whole number >= 1"):
        main([*INFER, "--batched", "--slots", slots, "--out", str(tmp_path / "o.jsonl")])


@pytest.mark.parametrize("args, why", [
    (["--devices", "abc"], r"--devices 'abc': use a count >= 1, 'auto', -1 \(every GPU\), or device ids"),
    (["--devices", "0"], r"--devices '0'"),
    (["--devices", "-2"], r"--devices '-2'"),
    (["--strategy", "bogus"], r"--strategy bogus: .*choose another --strategy"),
    (["--precision", "bogus"], r"--precision bogus: .*choose another --precision"),
    (["--accelerator", "bogus"], r"--accelerator bogus: .*choose another --accelerator"),
])
def test_inference_trainer_settings_are_one_error(tmp_path, args, why, no_models):
    from domino_lab.inference import main

    with pytest.raises(UserError, match=why):
        main([*INFER, *args, "--out", str(tmp_path / "o.jsonl")])
    assert _leftovers(tmp_path) == []


def test_inference_gpu_on_a_machine_without_one(tmp_path, no_models):
    import torch

    from domino_lab.inference import main

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(UserError, match="--accelerator gpu: this machine has no GPU.*use --accelerator cpu"):
        main([*INFER, "--accelerator", "gpu", "--out", str(tmp_path / "o.jsonl")])


def test_inference_devices_as_lightning_takes_them():
    from domino_lab.inference import parse_devices

    assert parse_devices("auto") == "auto"
    assert parse_devices("2") == 2
    assert parse_devices("0,1") == [0, 1] and parse_devices("-1") == -1


# --- bench ------------------------------------------------------------------------------------------------------------

BENCH = ["--sets", "math", "--limit", "2", "--max-new-tokens", "8", "--warmup", "0", "--methods", "ar", "domino"]


def test_bench_refuses_bad_out_before_loading(tmp_path, a_file, no_models):
    from domino_lab.bench import main

    cases = [(str(a_file), "is a file, not a folder"), (str(a_file / "sub"), "goes through")]
    if not NO_PROC:
        cases.append(("/proc/x", "cannot create anything in /proc"))
    for out, why in cases:
        with pytest.raises(UserError, match=why):
            main([*BENCH, "--out", out])
    assert a_file.read_text() == "keep me"


@pytest.mark.parametrize("uri, why", [
    ("bogus://x", "MLflow has no store for 'bogus'"),
    ("/proc/x/mlruns", "--tracking-uri /proc/x/mlruns: MLflow no longer opens a folder"),
    ("sqlite:////proc/x/mlflow.db", "--tracking-uri /proc/x/mlflow.db: cannot create anything"),
])
def test_bench_refuses_bad_tracking_uri_before_loading(tmp_path, uri, why, no_models, monkeypatch):
    from domino_lab.bench import main

    if NO_PROC and "/proc" in uri:
        pytest.skip("needs /proc")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(UserError, match=why):
        main([*BENCH, "--out", str(tmp_path / "bench"), "--mlflow", "--tracking-uri", uri])
    assert _leftovers(tmp_path) == []


# --- experiment scripts -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, args", [
    ("tree", ["--quick"]),
    ("speed_pair", []),
    ("batch_drafts", []),
    ("copy_gap", ["--quick"]),
    ("window_cache", []),
    ("kv_cache", []),
    ("head_screen", ["--quick"]),
    ("packed_linears", ["--quick"]),
])
def test_experiment_scripts_refuse_a_file_as_out_folder(name, args, a_file, no_models):
    with pytest.raises(UserError, match="is a file, not a folder"):
        experiment_script(name).main([*args, "--out", str(a_file)])
    assert a_file.read_text() == "keep me"


@pytest.mark.skipif(NO_PROC, reason="needs /proc")
@pytest.mark.parametrize("name, args, out", [
    ("tree", ["--quick"], "/proc/x"),
    ("regime_map", ["--quick"], "/proc/x/regime"),
    ("seed_summary", ["--runs", "a.json", "--pair", "a", "b"], "/proc/x/s.md"),
])
def test_experiment_scripts_refuse_an_unwritable_out(name, args, out, no_models):
    with pytest.raises(UserError, match="cannot create anything in /proc"):
        experiment_script(name).main([*args, "--out", out])


def test_batch_drafts_needs_a_drafter(no_models):
    with pytest.raises(UserError, match="--drafter none: .*name a drafter"):
        experiment_script("batch_drafts").main(["--drafter", "none"])


def test_a_quoted_tilde_is_checked_where_it_is_written(tmp_path, monkeypatch):
    # a shell leaves a quoted ~ alone and the writers do not expand it: the check looks at ./~ as they will
    from domino_lab.errors import check_out_dir

    monkeypatch.chdir(tmp_path)
    (tmp_path / "~").write_text("a file named ~")
    with pytest.raises(UserError, match="goes through"):
        check_out_dir("~/results")
