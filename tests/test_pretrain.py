"""Target pretraining CLI (`python -m domino_lab.pretrain`) and the target card script."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from domino_lab.errors import UserError, run_cli
from domino_lab.pretrain.__main__ import main
from domino_lab.pretrain.recipe import SHIPPED_DIR, TrainRecipe, apply_quick, load_recipe, recipe_from_dict

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "experiments" / "configs" / "target.yaml"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _cli(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "domino_lab.pretrain", *map(str, args)],
                          cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600)


def _one_error_line(stderr: str) -> str:
    lines = [l for l in stderr.splitlines() if l.strip()]
    errors = [l for l in lines if l.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    return errors[0]


@pytest.fixture(scope="module")
def quick_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("quick")
    out = root / "target"
    r = _cli("--config", RECIPE, "--quick", "--out", out, "--cache-dir", root / "cache")
    assert r.returncode == 0, r.stderr[-3000:]
    return out, json.loads(r.stdout.strip().splitlines()[-1])


def test_recipe_file_loads_with_seed():
    recipe = load_recipe(RECIPE)
    assert isinstance(recipe.train.seed, int)
    assert recipe.model.vocab_size == 8192


def test_quick_pretraining_end_to_end(quick_model):
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, summary = quick_model
    assert summary["tokens_seen"] > 0 and summary["steps"] == 3
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.eos_token_id == tok.convert_tokens_to_ids("<|endoftext|>") == tok.eos_token_id
    assert tok.mask_token_id is not None and tok.mask_token_id != tok.eos_token_id
    assert model.config.tie_word_embeddings
    assert model.config.max_position_embeddings == 64  # the quick recipe's training window
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}
    meta = json.loads((out / "train_meta.json").read_text())
    for key in ("parameters", "tokens_seen", "steps", "train_wall_time_s", "val_loss_code", "val_loss_math",
                "machine", "recipe"):
        assert key in meta
    assert meta["quick"] is True and math.isfinite(meta["val_loss_code"])
    ids = tok("Question: Ann has 3 apples.", return_tensors="pt")
    gen = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert gen.shape[1] == ids["input_ids"].shape[1] + 4 or gen[0, -1] == tok.eos_token_id
    assert not [p for p in out.parent.iterdir() if ".partial-" in p.name]  # export left no temp folder
    runs = out.parent / f".{out.name}-runs"                    # (--quick's runs folder, beside --out)
    assert runs.is_dir() and not list(runs.rglob("*.ckpt"))     # checkpoint_every_steps 0: no checkpoint


def test_unknown_yaml_key_is_one_error_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  seed: 0\n  learning_rate: 0.1\n")
    # in-process through run_cli, the wrapper `python -m domino_lab.pretrain` runs main with
    # (the real subprocess path is exercised by the quick end-to-end run; imports cost ~10 s a process)
    with pytest.raises(SystemExit) as e:
        run_cli(main, ["--config", str(bad), "--quick", "--out", str(tmp_path / "o")])
    assert e.value.code == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "train.learning_rate" in line
    assert not (tmp_path / "o").exists()


BROKEN = [  # (section, key, value, the key the error line names)
    ("train", "lr", -1.0, "train.lr"), ("train", "lr", math.inf, "train.lr"), ("train", "seed", -1, "train.seed"),
    ("train", "seed", 2**32, "train.seed"), ("train", "threads", 0, "train.threads"),
    ("train", "betas", [0.9], "train.betas"), ("train", "betas", [0.9, 1.0], "train.betas[1]"),
    ("train", "max_steps", 0, "train.max_steps"), ("train", "max_minutes", 0.0, "train.max_minutes"),
    ("train", "weight_decay", -0.1, "train.weight_decay"), ("train", "val_every_steps", 0, "train.val_every_steps"),
    ("model", "rope_theta", -5.0, "model.rope_theta"), ("model", "hidden_size", 0, "model.hidden_size"),
    ("model", "num_key_value_heads", 3, "model.num_key_value_heads"), ("model", "head_dim", 63, "model.head_dim"),
    ("model", "vocab_size", 100, "model.vocab_size"), ("data", "code_share", 1.5, "data.code_share"),
    ("data", "code_share", -0.5, "data.code_share"), ("data", "seq_len", 1, "data.seq_len"),
    ("data", "val_windows", 0, "data.val_windows"),
]


@pytest.mark.parametrize("section, key, value, named", BROKEN, ids=[f"{s}.{k}={v}" for s, k, v, _ in BROKEN])
def test_out_of_range_recipe_value_is_one_error_line(section, key, value, named, tmp_path, capsys, monkeypatch):
    import yaml

    import domino_lab.pretrain.train as pretrain_train

    monkeypatch.setattr(pretrain_train, "train", lambda *a, **k: pytest.fail("training started on a broken recipe"))
    raw = yaml.safe_load(RECIPE.read_text())
    raw[section][key] = value
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    out, runs = tmp_path / "o", tmp_path / "r"
    with pytest.raises(SystemExit) as e:
        run_cli(main, ["--quick", "--config", str(bad), "--out", str(out), "--runs-dir", str(runs),
                       "--cache-dir", str(tmp_path / "cache")])
    assert e.value.code == 2
    assert _one_error_line(capsys.readouterr().err).startswith(f"error: {named} ")
    assert not out.exists() and not runs.exists()


def test_a_run_that_diverges_exports_nothing(tmp_path, capsys):
    """A learning rate the checks cannot call wrong (finite, positive) can still drive every loss to NaN: such a run
    ends in one error line naming the loss and the knob, and --out is not written."""
    import yaml

    raw = yaml.safe_load(RECIPE.read_text())
    raw["train"]["lr"] = 1e10
    bad = tmp_path / "hot.yaml"
    bad.write_text(yaml.safe_dump(raw))
    out = tmp_path / "o"
    with pytest.raises(SystemExit) as e:
        run_cli(main, ["--quick", "--config", str(bad), "--out", str(out), "--cache-dir", str(tmp_path / "cache")])
    assert e.value.code == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith("error: training diverged: val/loss_") and "lower train.lr" in line
    assert not out.exists()


@pytest.mark.parametrize("name", ["target.yaml", "target_stage2.yaml", "target_stage3.yaml", "assistant.yaml"])
def test_shipped_recipes_pass_the_range_checks(name):
    apply_quick(load_recipe(REPO / "experiments" / "configs" / name))


def test_unknown_section_and_bad_type():
    with pytest.raises(UserError, match="optimizer"):
        recipe_from_dict({"optimizer": {}})
    with pytest.raises(UserError, match="train.lr"):
        recipe_from_dict({"train": {"lr": "fast"}})


def test_recipes_resolve_from_any_directory(tmp_path, monkeypatch):
    """The same recipe from another directory: found in the repository, its paths the repository's (an input
    export, the assistant's output folder) or under the runs folder (`runs/...`)."""
    monkeypatch.chdir(tmp_path)
    stage2 = load_recipe("experiments/configs/target_stage2.yaml")
    assert stage2.train.init_from == str(REPO / "domino_lab" / "assets" / "target")
    assistant = load_recipe("experiments/configs/assistant.yaml", runs_dir=tmp_path / "r")
    assert assistant.out_dir == str(REPO / "domino_lab" / "assets" / "assistant")
    assert assistant.data.regenerated == str(tmp_path / "r" / "regenerated" / "default")
    assert assistant.train.tokenizer_from == "default"                  # a name stays a name
    assert load_recipe("experiments/configs/assistant.yaml").data.regenerated == \
        str(REPO / "runs" / "regenerated" / "default")


def test_missing_recipe_file(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_recipe(tmp_path / "nope.yaml")


def test_unwritable_cache_dir_via_cli(tmp_path, capsys):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    with pytest.raises(SystemExit) as e:  # in-process through the same run_cli wrapper the CLI uses
        run_cli(main, ["--config", str(RECIPE), "--quick", "--out", str(tmp_path / "o"),
                       "--cache-dir", str(blocker / "cache")])
    assert e.value.code == 2
    assert "not writable" in _one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "o").exists()


def test_quick_never_overwrites_the_shipped_asset():
    with pytest.raises(UserError, match="shipped"):
        main(["--config", str(RECIPE), "--quick", "--out", str(SHIPPED_DIR)])


def test_quick_overrides_keep_it_tiny():
    r = apply_quick(load_recipe(RECIPE))
    tokens = r.train.max_steps * r.train.batch_size * r.data.seq_len
    assert tokens < 1000 and r.model.hidden_size <= 64


def test_lr_schedule_warmup_then_cosine_to_floor():
    from domino_lab.pretrain.module import TargetLM
    from domino_lab.pretrain.recipe import ModelShape

    cfg = TrainRecipe(max_steps=1000, warmup_steps=10, min_lr_ratio=0.1, max_minutes=1e6)
    m = TargetLM(ModelShape(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=8, intermediate_size=32), cfg, eos_id=0)
    f = [m.lr_factor(s) for s in range(1001)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a >= b - 1e-12 for a, b in zip(f[10:], f[11:]))  # monotone decay after warmup
    assert f[1000] == pytest.approx(0.1)
    # the wall-clock budget also drives progress: with 0 minutes left the LR is at its floor
    m.train_cfg = TrainRecipe(max_steps=1000, warmup_steps=10, min_lr_ratio=0.1, max_minutes=1e-9)
    m._t0 = 0.0
    assert m.lr_factor(50) == pytest.approx(0.1) and m.progress(50) >= 1.0


def test_target_card_on_quick_model(quick_model, tmp_path):
    out, _ = quick_model
    md = tmp_path / "card.md"
    r = subprocess.run([sys.executable, str(REPO / "experiments" / "target_card.py"), "--model", str(out),
                        "--out", str(md), "--limit", "4", "--max-new-tokens", "8", "--loss-tokens", "512",
                        "--cache-dir", str(out.parent / "cache")],
                       cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    text = md.read_text()
    for needle in ("Parameters", "Tokens seen", "Held-out loss", "Math final-answer accuracy", "HumanEval",
                   "Degeneration", "Greedy decode step"):
        assert needle in text, needle
    metrics = json.loads(md.with_suffix(".json").read_text())
    assert 0.0 <= metrics["degeneration"]["overall"] <= 1.0
    assert 0.0 <= metrics["humaneval_parse_rate"] <= 1.0


def test_quality_helpers():
    from domino_lab.pretrain.quality import cut_at_function_end, final_answer, is_looping, parses

    assert final_answer("x\n#### 1,234") == 1234 and final_answer("#### -5") == -5 and final_answer("no") is None
    assert is_looping([1, 2, 3] * 30)
    assert is_looping(list(range(40)) + [7] * 40)
    assert not is_looping(list(range(100)))
    assert not is_looping([1, 2] * 5)  # stopped early on its own: not a loop
    body = "\n    return x + 1\n\n\ndef other():\n    pass"
    assert cut_at_function_end(body) == "\n    return x + 1\n\n"
    assert parses("def f(x):" + cut_at_function_end(body))
    assert not parses("def f(x):\n    return (")


def test_assistant_from_regenerated_data_shares_the_target_tokenizer(tmp_path):
    """The `hf-assisted` bench baseline: a small AR model trained on the target's own responses."""
    import yaml
    from transformers import AutoTokenizer

    from core_helpers import make_target_dir
    from domino_lab.bench import load_assistant
    from domino_lab.data.regenerate import regenerate
    from domino_lab.target import Target

    tdir = make_target_dir(tmp_path / "target", max_pos=256)
    target = Target.from_pretrained(str(tdir))
    words = ["def f", "Question:", "return", "Tom has", "x = ", "for i in"]
    prompts = [{"id": f"p{i}", "prompt": f"{words[i % 6]} {words[(i * 5) % 6]}", "domain": ("math", "code")[i % 2]}
               for i in range(24)]
    regenerate(target, prompts, tmp_path / "data", max_new_tokens=40, batch_size=8, progress=False)
    recipe = {"out_dir": str(tmp_path / "assistant"),
              "model": dict(vocab_size=len(AutoTokenizer.from_pretrained(tdir)), hidden_size=16, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=32,
                            max_position_embeddings=256),
              "data": dict(regenerated=str(tmp_path / "data"), seq_len=16, val_windows=1),
              "train": dict(batch_size=2, max_steps=3, warmup_steps=1, val_every_steps=1000, checkpoint_every_steps=0,
                            threads=1, tokenizer_from=str(tdir))}
    (tmp_path / "assistant.yaml").write_text(yaml.safe_dump(recipe))
    r = _cli("--config", tmp_path / "assistant.yaml", "--runs-dir", tmp_path / "runs")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["steps"] == 3
    assert AutoTokenizer.from_pretrained(tmp_path / "assistant").get_vocab() == target.tokenizer.get_vocab()
    assert load_assistant(str(tmp_path / "assistant"), target, "float32").config.num_hidden_layers == 1
