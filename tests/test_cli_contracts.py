"""Bad input found by trying the command lines as a new user would: each is one UserError (one `error:` line, exit 2)
raised before anything is decoded or written, and the outputs of good runs are not mixed with other processes'."""
import json
import logging
import subprocess
import sys

import pytest

from domino_lab.errors import UserError

LONG = "def f(x):\n    return x\n" * 300            # ~2,700 tokens: over the embedded target's 512


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_eval_set_names_that_are_empty_or_missing_files_say_so():
    from domino_lab.data.eval_sets import load_eval_set

    with pytest.raises(UserError, match="the eval set name is empty"):
        load_eval_set("")
    with pytest.raises(UserError, match=r"'/nonexistent/p\.jsonl' is not a file \(no such file or folder\)"):
        load_eval_set("/nonexistent/p.jsonl")
    # a missing file with + in its name is one path, not sets joined by +
    with pytest.raises(UserError, match=r"'/nonexistent/a\+b\.jsonl' is not a file"):
        load_eval_set("/nonexistent/a+b.jsonl")
    with pytest.raises(UserError, match="'nope' is not a known evaluation set"):
        load_eval_set("math+nope")


def test_generate_with_an_empty_prompts_value_is_one_error(monkeypatch):
    from domino_lab import generate

    monkeypatch.setattr("domino_lab.Target.from_pretrained", lambda *a, **k: pytest.fail("loaded a target"))
    with pytest.raises(UserError, match="the eval set name is empty"):
        generate.main(["--prompts", ""])


def test_a_reader_that_leaves_the_pipe_ends_the_command_quietly():
    proc = subprocess.Popen([sys.executable, "-m", "domino_lab.generate", "--prompts", "math", "--drafter", "none",
                             "--max-new-tokens", "4", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()                  # the first prompt's line, then the reader is gone (as `| head -1`)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_bench_refuses_two_sets_under_one_name_and_long_prompts_before_decoding(tmp_path):
    from domino_lab.bench import main

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one = _jsonl(tmp_path / "a" / "p.jsonl", [{"id": "x", "prompt": "def f(x):"}])
    other = _jsonl(tmp_path / "b" / "p.jsonl", [{"id": "y", "prompt": "def g(x):"}])
    out = tmp_path / "out"
    with pytest.raises(UserError, match="would both be reported as 'p'"):
        main(["--sets", str(one), str(other), "--out", str(out)])
    mixed = _jsonl(tmp_path / "mixed.jsonl", [{"id": "ok", "prompt": "def f(x):"}, {"id": "long", "prompt": LONG}])
    with pytest.raises(UserError, match=r"prompt 'long' \(number 2 of set mixed\) has \d+ tokens but the target's "
                                        "context is 512"):
        main(["--sets", "math", str(mixed), "--limit", "2", "--methods", "ar", "--out", str(out)])
    assert not out.exists()


def test_inference_checks_every_prompt_and_the_prompts_per_process_before_decoding(tmp_path, monkeypatch):
    from domino_lab.inference import main, make_trainer, predict

    mixed = _jsonl(tmp_path / "mixed.jsonl", [{"id": "ok", "prompt": "def f(x):"}, {"id": "long", "prompt": LONG}])
    with pytest.raises(UserError, match=r"prompt 'long' \(number 2 of 2\) has \d+ tokens"):
        main(["--prompts", str(mixed), "--drafter", "none", "--out", str(tmp_path / "o.jsonl")])
    assert not (tmp_path / "o.jsonl").exists()
    # bad values are found before the trainer exists (making one prints Lightning's hardware lines)
    monkeypatch.setattr("domino_lab.inference.decoder.make_trainer", lambda *a, **k: pytest.fail("made a trainer"))
    for flags, match in ((["--limit", "0"], "limit must be"), (["--temperature", "-1"], "got temperature -1.0"),
                         (["--dtype", "float8"], "unknown dtype 'float8'"), (["--prompts", "nope"], "nope"),
                         (["--sampler", "gumbel"], "--sampler shapes sampling at T > 0")):
        with pytest.raises(UserError, match=match):
            main(["--prompts", "math", "--drafter", "none", "--out", str(tmp_path / "o.jsonl"), *flags])
    monkeypatch.undo()
    assert not (tmp_path / "o.jsonl").exists()
    # two processes for one prompt: one would get nothing (Lightning's sampler fails in it); the processes are only
    # started by predict, so the check runs in this one
    trainer = make_trainer("cpu", 2, "ddp")
    with pytest.raises(UserError, match=r"1 prompt\(s\) for 2 processes"):
        predict("default", None, [{"id": "a", "prompt": "def f(x):"}], trainer=trainer)


def test_regenerate_refuses_a_max_length_past_the_context(tmp_path):
    from domino_lab.regenerate import main

    prompts = _jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "def f(x):"}])
    with pytest.raises(UserError, match="max_length=100000 is longer than the target's 512-token context"):
        main(["--prompts", str(prompts), "--max-new-tokens", "8", "--max-length", "100000",
              "--out", str(tmp_path / "rg")])
    assert not (tmp_path / "rg").exists()


@pytest.mark.parametrize("flags, match", [
    (["--target", "/nonexistent/model"], "target '/nonexistent/model' is not a model directory"),
    # relative paths that cannot be a Hugging Face id (owner/name) are folders too, not ids with bad characters
    (["--target", "nonexistent/"], "target 'nonexistent/' is not a model directory"),
    (["--target", "runs/no/model"], "target 'runs/no/model' is not a model directory"),
    (["regen_math=-1"], "regen_math must be >= 0"),
    (["regen_max_new_tokens=0"], "regen_max_new_tokens must be >= 1"),
])
def test_sweep_creates_nothing_for_a_bad_target_or_data_size(tmp_path, flags, match):
    from domino_lab.sweep.__main__ import main

    runs = tmp_path / "x"
    with pytest.raises(UserError, match=match):
        main(["--runs-dir", str(runs), *flags])
    assert not runs.exists()


def test_train_refuses_more_taps_than_the_target_has_layers():
    from domino_lab import Target
    from domino_lab.training.config import DrafterOverrides, drafter_config

    t = Target.from_pretrained("default")
    for k in (0, 99):
        with pytest.raises(UserError, match=f"drafter.num_taps must be from 1 to the target's 6 layers, got {k}"):
            drafter_config(DrafterOverrides(num_taps=k), t)
    assert drafter_config(DrafterOverrides(num_taps=2), t).target_layer_ids == [1, 3]


def test_train_prints_its_result_once_under_data_parallelism(monkeypatch, capsys):
    """Every process of a data-parallel run returns from `train`; only rank 0 holds the result and prints it (a
    script reading stdout got rank 1's empty result first)."""
    from lightning.pytorch.utilities import rank_zero_only

    from domino_lab import train as train_cli

    monkeypatch.setattr(train_cli, "resolve_config", lambda argv: (None, False))
    monkeypatch.setattr(train_cli, "train", lambda cfg, resume: {"best_tau": 2.0})
    for rank, printed in ((1, ""), (0, '"best_tau": 2.0')):
        monkeypatch.setattr(rank_zero_only, "rank", rank)
        assert train_cli.main([]) == 0
        out = capsys.readouterr().out
        assert (printed in out) if printed else out == ""


def test_lightning_tips_are_dropped_from_its_console_lines():
    from domino_lab.training.devices import quiet_lightning

    quiet_lightning()
    quiet_lightning()                        # once is enough: no second filter
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)     # where Lightning's rank-zero info lines are logged
        assert len([f for f in logger.filters if getattr(f, "_domino_lab", False)]) == 1
        record = lambda msg: logging.LogRecord(name, logging.INFO, __file__, 1, msg, (), None)  # noqa: E731
        assert not logger.filter(record("💡 Tip: For seamless cloud logging, try installing something"))
        assert logger.filter(record("GPU available: False, used: False"))


def test_only_torchs_notice_inside_lightnings_pytree_helper_is_silenced():
    import warnings

    from domino_lab.training.devices import quiet_lightning

    notice = "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec)` instead."
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_lightning()
        for module, text in (("lightning.pytorch.utilities._pytree", notice),      # silenced
                             ("lightning.pytorch.utilities._pytree", "another deprecation"),
                             ("domino_lab.training.module", notice)):
            warnings.warn_explicit(text, DeprecationWarning, "x.py", 1, module=module)
    assert [(str(w.message)) for w in seen] == ["another deprecation", notice]


def test_bench_says_which_drafters_the_batched_table_leaves_out(tmp_path):
    from domino_lab.bench import main

    out = tmp_path / "b"
    main(["--sets", "math", "--limit", "1", "--max-new-tokens", "4", "--warmup", "0", "--methods", "ar",
          "--drafter", "e=default-eagle", "--drafter", "dc=default@draft_cutoff=0.1", "--drafter", "d=default",
          "--drafter", "b2=default@block_size=2", "--batch-sizes", "2", "--out", str(out)])
    meta = json.loads((out / "bench.json").read_text())["meta"]
    assert set(meta["batched_left_out"]) == {"e", "dc", "b2"}
    assert "one sequence at a time" in meta["batched_left_out"]["e"]
    assert "block size" in meta["batched_left_out"]["b2"]
    md = (out / "bench.md").read_text()
    assert all(f"Not in the batched table: `{m}`" in md for m in ("e", "dc", "b2"))
    assert "Not in the batched table: `d`" not in md


@pytest.mark.parametrize("flags, match", [
    (["--continuous"], "--continuous shapes the batched rows.*add --batch-sizes"),
    (["--batch-rounds", "3"], "--batch-rounds shapes the batched rows, and this run measures batch 1 only"),
    (["--batch-drafts", "all"], "--batch-drafts shapes the batched rows"),
    (["--top-p", "0.5"], r"--top-p shapes sampling at T > 0, and this run is greedy: add --temperature T"),
    (["--sampler", "gumbel"], r"--sampler shapes sampling at T > 0"),
    (["--tracking-uri", "sqlite:///x.db"], "--tracking-uri says where --mlflow logs: add --mlflow"),
    (["--methods", "ar", "dflash", "--tree-min-prob", "0.03"], "--tree-min-prob shapes the trees .* none is benched"),
    (["--methods", "ar", "domino", "--tree-sampled"], "--tree-sampled shapes the trees"),
    (["--draft-cutoff", "0.2"], "--draft-cutoff shortens chains, and dflash-tree verifies a tree"),
    (["--methods", "dflash", "--dflash", "default"], "--dflash default: the dflash method measures a block drafter "
                                                     "without a head, and this one drafts with its head"),
    (["--methods", "domino-tree", "--domino", "default-dflash"], "--domino default-dflash: the domino-tree method "
                                                                  "measures a drafter with the Domino head"),
    (["--methods", "ar", "domino", "--dflash", "nowhere"], "--dflash is read by the methods dflash, dflash-tree, and "
                                                           "none of them is benched: add one to --methods, or drop"),
    (["--methods", "ar", "dflash", "--domino", "default"], "--domino is read by the methods domino, domino-eager"),
    (["--methods", "ar", "--assistant", "x"], "--assistant is read by the methods hf-assisted, and none"),
])
def test_bench_refuses_flags_it_would_ignore(tmp_path, flags, match):
    from domino_lab.bench import main

    with pytest.raises(UserError, match=match):
        main(["--sets", "math", "--quick", "--out", str(tmp_path / "b"), *flags])
    assert not (tmp_path / "b").exists()


def test_bench_quick_keeps_the_sizes_given_beside_it(tmp_path):
    from domino_lab.bench import main

    main(["--sets", "math", "--quick", "--methods", "ar", "--max-new-tokens", "4", "--out", str(tmp_path / "b")])
    meta = json.loads((tmp_path / "b" / "bench.json").read_text())["meta"]
    assert meta["max_new_tokens"] == 4
    res = json.loads((tmp_path / "b" / "bench.json").read_text())["results"]["math"]["ar"]
    assert res["prompts"] == 2                 # --quick's limit, as no --limit was given


def test_train_refuses_an_out_dir_that_is_a_file_before_loading_anything(tmp_path, monkeypatch):
    from domino_lab.train import main

    monkeypatch.setattr("domino_lab.target.Target.from_pretrained", lambda *a, **k: pytest.fail("loaded a target"))
    (tmp_path / "run.jsonl").write_text("")
    with pytest.raises(UserError, match="out_dir .*run.jsonl is a file, not a folder; choose another out_dir"):
        main(["--config", "experiments/configs/domino.yaml", "data.path=runs/regenerated/sweep-default",
              f"tracking_uri=sqlite:///{tmp_path}/ml.db", f"out_dir={tmp_path}/run.jsonl", "max_steps=1"])
    assert not (tmp_path / "ml.db").exists()


@pytest.mark.parametrize("module", ["domino_lab.train", "domino_lab.sweep.__main__", "domino_lab.experiments.__main__"])
def test_a_config_that_is_not_utf8_or_an_override_that_is_not_yaml_is_one_error(tmp_path, module, monkeypatch):
    """Both used to end in a traceback (UnicodeDecodeError, yaml's ScannerError) from every CLI that reads configs."""
    import importlib

    monkeypatch.setattr("domino_lab.target.Target.from_pretrained", lambda *a, **k: pytest.fail("loaded a target"))
    main = importlib.import_module(module).main
    lead = ["run", "block_size"] if "experiments" in module else []
    runs = [] if module == "domino_lab.train" else ["--runs-dir", str(tmp_path / "runs")]
    runs += ["--out-dir", str(tmp_path / "out")] if lead else []
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"max_steps: 3  # caf\xe9\n")
    with pytest.raises(UserError, match=r"bad.yaml is not UTF-8 text \(byte 0xe9 at offset 19\); save it as UTF-8"):
        main([*(["run", str(bad)] if lead else ["--config", str(bad)]), *runs])
    with pytest.raises(UserError, match=r"override 'max_steps=\[1,': the value is not valid YAML"):
        main([*lead, *runs, "max_steps=[1,"])
    assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()


def test_a_block_that_cannot_fit_the_context_is_refused():
    from core_helpers import tiny_target
    from domino_lab import Drafter

    t = tiny_target(max_pos=24)
    with pytest.raises(UserError, match="block_size 24 must be smaller than the context of 24 positions"):
        Drafter.untrained(t, "domino", block_size=24)
    assert Drafter.untrained(t, "domino", block_size=8).config.block_size == 8


@pytest.mark.parametrize("flags, match", [
    (["--tree-nodes", "8", "--draft-cutoff", "0.5"], "--draft-cutoff shortens a chain's drafts, and this run verifies "
                                                     "trees"),
    (["--tree-nodes", "8", "--tree-sampled"], "--tree-sampled samples a tree's nodes at T > 0"),
    (["--top-p", "0.9"], "--top-p shapes sampling at T > 0, and this run is greedy"),
    (["--sampler", "gumbel"], "--sampler shapes sampling at T > 0, and this run is greedy"),
])
def test_generate_refuses_tree_and_sampling_flags_it_would_ignore(flags, match, monkeypatch):
    from domino_lab import generate

    monkeypatch.setattr("domino_lab.Target.from_pretrained", lambda *a, **k: pytest.fail("loaded a target"))
    with pytest.raises(UserError, match=match):
        generate.main(["--prompt", "def f(x):", "--max-new-tokens", "4", *flags])


def test_export_refuses_a_verifier_its_format_does_not_record(tmp_path):
    from domino_lab.export import main

    with pytest.raises(UserError, match="--verifier is recorded by the speculators format only"):
        main(["--drafter", "default", "--format", "domino", "--out", str(tmp_path / "e"), "--verifier", "foo"])
    assert not (tmp_path / "e").exists()


def test_empty_names_are_one_error_each(tmp_path):
    from domino_lab import Target
    from domino_lab.experiments.__main__ import main as experiments
    from domino_lab.export import main as export
    from domino_lab.models import load_drafter
    from domino_lab.regenerate import main as regenerate
    from domino_lab.sweep.__main__ import main as sweep

    with pytest.raises(UserError, match="--out is empty; name a folder"):
        regenerate(["--n-math", "1", "--out", ""])
    with pytest.raises(UserError, match="--out is empty; name a folder"):
        export(["--drafter", "default-nocopy", "--format", "domino", "--out", ""])
    with pytest.raises(UserError, match="--study-name is empty"):
        sweep(["--study-name", "", "--prepare-only", "--runs-dir", str(tmp_path / "sw")])
    assert not (tmp_path / "sw").exists()
    with pytest.raises(UserError, match="the drafter name is empty"):
        load_drafter("", Target.from_pretrained("default"))
    with pytest.raises(UserError, match=r"^--runs-dir /proc/x: cannot create anything in /proc"):
        experiments(["run", "block_size", "--quick", "--runs-dir", "/proc/x"])
    with pytest.raises(UserError, match=r"^--out-dir /proc/x: cannot create anything in /proc"):
        experiments(["run", "block_size", "--quick", "--out-dir", "/proc/x", "--runs-dir", str(tmp_path / "r")])


CLI_MAINS = ["domino_lab.generate", "domino_lab.bench", "domino_lab.train", "domino_lab.export", "domino_lab.inference",
             "domino_lab.regenerate", "domino_lab.pretrain.__main__", "domino_lab.sweep.__main__",
             "domino_lab.experiments.__main__", "domino_lab.data.eval_sets", "domino_lab.tour", "app.main"]


@pytest.mark.parametrize("module", CLI_MAINS)
def test_a_bad_command_line_is_one_error_line_that_points_to_help(module, capsys):
    """argparse's own complaint (here an unknown option, or the required ones missing) as the project's one line."""
    import importlib

    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as exit_:
        main(["--no-such-option"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and err.endswith(" --help\n"), err


HEAVY = ("torch", "transformers", "lightning", "gradio", "mlflow", "optuna", "datasets")
PROBE = """import contextlib, io, runpy, sys
sys.argv = [sys.argv[1]] + sys.argv[2:]
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    try:
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code
print(code, [m for m in %r if m in sys.modules])
""" % (HEAVY,)


@pytest.mark.parametrize("module", [m.removesuffix(".__main__") for m in CLI_MAINS])
def test_help_and_a_bad_flag_answer_before_any_heavy_import(module):
    """The package's promise: a CLI builds and reads its parser before torch, transformers or Lightning load
    (several seconds each), so `--help` and argparse's one-line error come at once."""
    for argv, code in ((["--help"], "0"), (["--no-such-option"], "2")):
        out = subprocess.run([sys.executable, "-c", PROBE, module, *argv], capture_output=True, text=True,
                             timeout=120)
        assert out.stdout.strip() == f"{code} []", (module, argv, out.stdout, out.stderr[-2000:])


def test_a_bad_value_in_a_subcommand_names_the_subcommand(capsys):
    from domino_lab.experiments.__main__ import main

    with pytest.raises(SystemExit):
        main(["run", "same_data", "--threads", "x"])
    assert capsys.readouterr().err == ("error: argument --threads: invalid int value: 'x'; "
                                       "see python -m domino_lab.experiments run --help\n")


def test_every_command_line_uses_the_one_line_parser():
    """A parser built with argparse.ArgumentParser itself would print its usage block before the error."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    direct = [str(p.relative_to(root)) for folder in ("domino_lab", "app", "experiments")
              for p in (root / folder).rglob("*.py") if "argparse.ArgumentParser(" in p.read_text()]
    # the interop fixture's script also runs under the release's own interpreter, which has no domino_lab
    assert direct == ["experiments/interop/make_fixture.py"]
