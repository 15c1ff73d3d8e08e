"""Target regeneration: output layout, batching equivalence, resumability, CLI errors.

Everything runs on a tiny random Qwen3 with a BPE trained here on a few KB of text (not the shipped
asset), so these tests do not depend on the embedded target existing.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from domino_lab.data.eval_sets import MAX_CONTEXT_CHARS
from domino_lab.errors import UserError
from domino_lab.data.regenerate import (SHARD_DIR, content_digest, data_digest, load_meta, load_regenerated, regenerate,
                                       training_prompts)
from domino_lab.target import Target

REPO = Path(__file__).resolve().parents[1]
COLUMNS = {"id", "domain", "input_ids", "loss_mask", "prompt_len"}
EOS = 0

_TEXT = '''
def add(a, b):
    """Return the sum of a and b."""
    return a + b

class Stack:
    def __init__(self):
        self.items = []

    def push(self, x):
        self.items.append(x)

    def pop(self):
        if not self.items:
            raise IndexError("pop from empty stack")
        return self.items.pop()

Question: Ben has 12 marbles. He buys 5 more. How many marbles does Ben have now?
Answer: Ben has 12+5 = <<12+5=17>>17 marbles.
#### 17
'''


def _prompts(n: int = 13) -> list[dict]:
    # Different lengths on purpose: left padding must be exercised.
    bases = ["def f(x):", "class A:\n    def push(self, x):", "Question: Ben has 12 marbles.\nAnswer:",
             "import os\n\ndef main():\n    \"\"\"Entry point.\"\"\"", "x", "return self.items"]
    return [{"id": f"p{i}", "prompt": bases[i % len(bases)] + " " * (i // len(bases)),
             "domain": "math" if i % 2 else "code"} for i in range(n)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    d = tmp_path_factory.mktemp("tiny_target")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([_TEXT] * 20, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", "<|mask|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                  mask_token="<|mask|>")
    assert tok.eos_token_id == EOS
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                      eos_token_id=EOS, pad_token_id=EOS, bos_token_id=None, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg).eval()
    # A random model almost never says EOS. Give EOS a scaled copy of the output row of the token the
    # model picks most often, so some responses stop early and others hit max_new_tokens: both
    # paths of the loss mask get exercised.
    ids = tok([p["prompt"] for p in _prompts(6)], add_special_tokens=False)["input_ids"]
    picks = torch.cat([model.generate(torch.tensor([x]), max_new_tokens=8, do_sample=False)[0, len(x):]
                       for x in ids])
    common = int(torch.mode(picks).values)
    with torch.no_grad():
        model.lm_head.weight[EOS] = 1.5 * model.lm_head.weight[common]
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture()
def target(tiny_dir) -> Target:
    return Target.from_pretrained(str(tiny_dir))


def _rows(ds) -> dict[str, dict]:
    return {r["id"]: r for r in ds}


def test_output_columns_and_loss_mask(target, tmp_path):
    prompts = _prompts()
    ds = regenerate(target, prompts, tmp_path / "out", max_new_tokens=12, batch_size=4, progress=False)
    assert set(ds.column_names) == COLUMNS
    assert ds["id"] == [p["id"] for p in prompts]  # prompt order, one row each
    finished = 0
    for p, r in zip(prompts, ds):
        enc = target.tokenizer(p["prompt"], add_special_tokens=False)["input_ids"]
        pl = r["prompt_len"]
        assert pl == len(enc) and r["input_ids"][:pl] == enc
        assert r["domain"] == p["domain"]
        resp = r["input_ids"][pl:]
        assert 1 <= len(resp) <= 12
        assert r["loss_mask"] == [0] * pl + [1] * len(resp)
        # EOS, if generated, is the last token and counts as a target; nothing follows it
        assert EOS not in resp[:-1]
        if resp[-1] == EOS:
            finished += 1
        else:
            assert len(resp) == 12
    assert 0 < finished < len(prompts), "fixture should make some (not all) responses stop at EOS"
    meta = load_meta(tmp_path / "out")
    assert meta["rows"] == len(prompts) and meta["counts"] == {"code": 7, "math": 6}
    assert meta["truncated_without_eos"] == len(prompts) - finished
    assert meta["temperature"] == 0.0 and meta["max_new_tokens"] == 12


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_batched_greedy_equals_one_at_a_time(tiny_dir, tmp_path, dtype):
    tgt = Target.from_pretrained(str(tiny_dir), dtype=dtype)
    prompts = _prompts(10)
    batched = regenerate(tgt, prompts, tmp_path / "b", max_new_tokens=16, batch_size=5, progress=False)
    single = regenerate(tgt, prompts, tmp_path / "s", max_new_tokens=16, batch_size=1, progress=False)
    same = [a == b for a, b in zip(batched["input_ids"], single["input_ids"])]
    if dtype == torch.float64:
        assert all(same)
    else:
        # float32 matmuls of different batch shapes may round differently, which can flip a
        # near-tie argmax; identical here, but allow one row so other CPUs do not make this flaky
        assert sum(same) >= len(same) - 1
    # and one-at-a-time equals a plain, unpadded HF greedy decode of each prompt
    for p, ids in zip(prompts, single["input_ids"]):
        x = torch.tensor([tgt.tokenizer(p["prompt"], add_special_tokens=False)["input_ids"]])
        ref = tgt.model.generate(x, max_new_tokens=16, do_sample=False, eos_token_id=EOS, pad_token_id=EOS)[0]
        assert ids == ref.tolist()[: len(ids)]


def test_resume_after_interruption_has_no_duplicates_and_redoes_nothing(target, tmp_path):
    prompts = _prompts(13)
    out = tmp_path / "out"
    real_generate = target.model.generate
    calls = []

    def dying_generate(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape[0])
        if len(calls) == 3:
            raise KeyboardInterrupt  # what Ctrl-C mid-batch looks like
        return real_generate(*args, **kwargs)

    target.model.generate = dying_generate
    with pytest.raises(KeyboardInterrupt):
        regenerate(target, prompts, out, max_new_tokens=10, batch_size=4, progress=False)
    shards = sorted((out / SHARD_DIR).glob("shard-*.arrow"))
    assert len(shards) == 2  # the two finished batches, nothing from the killed one
    with pytest.raises(UserError, match="incomplete"):
        load_regenerated(out)
    # a folder that regenerate never wrote is called that, not an interrupted run
    other = tmp_path / "prompts"
    other.mkdir()
    (other / "p.jsonl").write_text('{"id": "a", "prompt": "x"}\n')
    with pytest.raises(UserError, match="prompts is not a folder of regenerated data .*regenerate --out DIR"):
        load_regenerated(other)

    calls.clear()
    target.model.generate = lambda *a, **k: (calls.append(k["input_ids"].shape[0]), real_generate(*a, **k))[1]
    ds = regenerate(target, prompts, out, max_new_tokens=10, batch_size=4, progress=False)
    assert sum(calls) == len(prompts) - 8, "finished prompts must not be generated again"
    assert sorted(ds["id"]) == sorted(p["id"] for p in prompts) and len(set(ds["id"])) == len(ds)
    assert load_meta(out)["generated_this_run"] == len(prompts) - 8

    # A third run finds everything done: no generation, identical dataset.
    calls.clear()
    again = regenerate(target, prompts, out, max_new_tokens=10, batch_size=4, progress=False)
    assert calls == [] and again["input_ids"] == ds["input_ids"]

    # Greedy is deterministic, so resuming gives exactly what one uninterrupted run gives.
    target.model.generate = real_generate
    fresh = regenerate(target, prompts, tmp_path / "fresh", max_new_tokens=10, batch_size=4, progress=False)
    assert fresh["input_ids"] == ds["input_ids"]
    # and the content digest says so: the same rows, written in one go or across an interruption
    assert load_meta(out)["data_digest"] == load_meta(tmp_path / "fresh")["data_digest"] == content_digest(ds)


def test_data_digest_changes_with_any_token_and_is_computed_for_older_data(target, tmp_path):
    out = tmp_path / "out"
    ds = regenerate(target, _prompts(4), out, max_new_tokens=6, progress=False)
    digest = load_meta(out)["data_digest"]
    assert len(digest) == 16 and data_digest(out) == digest
    for column in ("input_ids", "loss_mask"):
        rows = [list(r) for r in ds[column]]
        rows[1][-1] ^= 1
        assert content_digest(ds.remove_columns(column).add_column(column, rows)) != digest, column
    renamed = list(ds["id"])
    renamed[0] += "x"
    assert content_digest(ds.remove_columns("id").add_column("id", renamed)) != digest
    # data written before meta.json recorded the digest: computed from the rows, the same value
    meta = json.loads((out / "meta.json").read_text())
    del meta["data_digest"]
    (out / "meta.json").write_text(json.dumps(meta))
    assert data_digest(out) == digest


def test_resume_regenerates_an_id_whose_prompt_text_changed(target, tmp_path):
    prompts = _prompts(5)
    out = tmp_path / "out"
    regenerate(target, prompts, out, max_new_tokens=6, progress=False)
    changed = [dict(p) for p in prompts]
    changed[2]["prompt"] = "def changed(self):"
    real_generate, calls = target.model.generate, []
    target.model.generate = lambda *a, **k: (calls.append(k["input_ids"].shape[0]), real_generate(*a, **k))[1]
    ds = regenerate(target, changed, out, max_new_tokens=6, progress=False)
    assert calls == [1]  # only the changed prompt
    enc = target.tokenizer("def changed(self):", add_special_tokens=False)["input_ids"]
    assert ds[2]["id"] == "p2" and ds[2]["input_ids"][: ds[2]["prompt_len"]] == enc
    assert len(ds) == 5 and len(set(ds["id"])) == 5


def test_killed_cli_run_resumes_without_duplicates(tiny_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"def f{i}(x):" + " y" * (i % 7)}) + "\n"
                               for i in range(60)))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "domino_lab.regenerate", "--target", str(tiny_dir), "--prompts", str(prompts),
           "--out", str(out), "--batch-size", "2", "--max-new-tokens", "48", "--no-progress", "--threads", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while len(list((out / SHARD_DIR).glob("shard-*.arrow"))) < 3 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)  # no cleanup handlers run: the harshest interruption
    proc.wait()
    before = len(list((out / SHARD_DIR).glob("shard-*.arrow")))
    assert before >= 3
    if before < 30:  # the kill landed mid-run (it practically always does)
        with pytest.raises(UserError, match="incomplete"):
            load_regenerated(out)
    # Resume with the same command (in-process to save a second interpreter start-up).
    from domino_lab.regenerate import main

    assert main(cmd[3:]) == 0
    ds = load_regenerated(out)
    assert sorted(ds["id"]) == sorted(f"q{i}" for i in range(60)) and len(set(ds["id"])) == 60
    assert load_meta(out)["generated_this_run"] == 60 - 2 * before  # batch size 2: nothing redone


def test_sampling_is_seeded_and_settings_must_match_to_resume(target, tmp_path):
    prompts = _prompts(6)
    a = regenerate(target, prompts, tmp_path / "a", max_new_tokens=10, temperature=1.0, seed=3, progress=False)
    b = regenerate(target, prompts, tmp_path / "b", max_new_tokens=10, temperature=1.0, seed=3, progress=False)
    g = regenerate(target, prompts, tmp_path / "g", max_new_tokens=10, progress=False)
    assert a["input_ids"] == b["input_ids"]
    assert a["input_ids"] != g["input_ids"]  # sampling really samples
    with pytest.raises(UserError, match="other settings"):
        regenerate(target, prompts, tmp_path / "a", max_new_tokens=10, temperature=0.0, progress=False)


def test_long_prompts_keep_their_end_within_max_length(target, tmp_path):
    long = {"id": "long", "prompt": "x = 1\n" * 60 + "def tail(y):", "domain": "code"}
    enc = target.tokenizer(long["prompt"], add_special_tokens=False)["input_ids"]
    assert len(enc) > 40
    ds = regenerate(target, [long], tmp_path / "o", max_new_tokens=8, max_length=40, progress=False)
    r = ds[0]
    assert r["prompt_len"] == 32 and r["input_ids"][:32] == enc[-32:]
    assert len(r["input_ids"]) <= 40
    with pytest.raises(UserError, match="no room"):
        regenerate(target, [long], tmp_path / "o2", max_new_tokens=40, max_length=40, progress=False)
    assert not (tmp_path / "o2").exists()


def test_bad_prompts_and_foreign_out_dir(target, tmp_path):
    with pytest.raises(UserError, match="unique"):
        regenerate(target, [{"id": "x", "prompt": "a"}, {"id": "x", "prompt": "b"}], tmp_path / "o", progress=False)
    with pytest.raises(UserError, match="empty"):
        regenerate(target, [{"id": "x", "prompt": "  "}], tmp_path / "o", progress=False)
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="not a regenerate output"):
        regenerate(target, _prompts(2), foreign, progress=False)
    assert os.listdir(foreign) == ["notes.txt"]
    with pytest.raises(UserError, match="no regenerated data"):
        load_regenerated(tmp_path / "nothing")


def test_training_prompts_come_from_training_splits():
    from domino_lab.data.corpora import is_heldout_path
    from domino_lab.data.math_gen import MATH_TRAIN_SEEDS

    ps = training_prompts(5, 7)
    assert [p["domain"] for p in ps] == ["math"] * 5 + ["code"] * 7
    assert len({p["id"] for p in ps}) == 12
    for p in ps[:5]:
        assert int(p["id"].split("/")[1]) in MATH_TRAIN_SEEDS and p["prompt"].endswith("\nAnswer:")
    for p in ps[5:]:
        assert not is_heldout_path(p["id"][len("code/"):].rsplit(":", 1)[0])
        assert "def " in p["prompt"] and len(p["prompt"]) <= MAX_CONTEXT_CHARS
    prose = training_prompts(0, 0, n_prose=6)
    assert [p["domain"] for p in prose] == ["prose"] * 6 and len({p["id"] for p in prose}) == 6
    assert all(p["prompt"].startswith(("# ", '"""')) for p in prose)
    assert training_prompts(2, 3, n_prose=6)[5:] == prose          # the third domain follows the other two


def _bad_args(tmp_path: Path, case: str) -> list[str]:
    afile = tmp_path / "file.txt"
    afile.write_text("x")
    return ["--target", "default"] + {
        "unknown_set": ["--prompts", "no_such_set", "--out", str(tmp_path / "o")],
        "out_under_file": ["--prompts", "humaneval", "--out", str(afile / "sub")],
        "bad_batch": ["--batch-size", "0", "--out", str(tmp_path / "o")],
        "bad_jsonl": ["--prompts", str(afile), "--out", str(tmp_path / "o")],
        "bad_prose": ["--n-prose", "-1", "--out", str(tmp_path / "o")],
        "nothing": ["--n-math", "0", "--n-code", "0", "--out", str(tmp_path / "o")],
        "count_with_prompts": ["--prompts", "humaneval", "--n-math", "5", "--out", str(tmp_path / "o")],
    }[case]


@pytest.mark.parametrize("case", ["unknown_set", "out_under_file", "bad_batch", "bad_jsonl", "bad_prose", "nothing",
                                  "count_with_prompts"])
def test_cli_bad_input_exits_2_with_one_error_line(tmp_path, case, capsys):
    from domino_lab.errors import run_cli
    from domino_lab.regenerate import main

    with pytest.raises(SystemExit) as e:
        run_cli(main, _bad_args(tmp_path, case))
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert not (tmp_path / "o").exists()  # nothing written for bad input
    if case == "unknown_set":
        assert all(name in lines[0] for name in ("humaneval", "math", "code"))
    if case == "bad_jsonl":
        assert "file.txt:1" in lines[0]
    if case == "count_with_prompts":
        assert "--n-math counts prompts of the training splits, and --prompts replaces them" in lines[0]


def test_cli_bad_input_in_a_real_process_has_no_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "domino_lab.regenerate", *_bad_args(tmp_path, "unknown_set")],
                       cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and r.stderr.startswith("error: ")
    assert "Traceback" not in r.stderr and not (tmp_path / "o").exists()


def test_generation_uses_the_growing_cache_unless_the_model_asks_for_its_own(target, tmp_path, monkeypatch):
    """Responses are generated through the decoders' in-place cache, with the same tokens as Hugging Face's own
    cache; a model whose generation config names a cache implementation keeps it."""
    from domino_lab.decoding import kv_cache

    seen = []
    generate = target.model.generate

    def spy(*args, **kwargs):
        seen.append(kwargs.get("cache"))
        return generate(*args, **kwargs)

    monkeypatch.setattr(target.model, "generate", spy)
    prompts = _prompts(8)
    ours = regenerate(target, prompts, tmp_path / "g", max_new_tokens=16, batch_size=4, progress=False)
    assert len(seen) == 2 and all(type(c.layers[0]) is kv_cache.GrowingLayer for c in seen)
    with kv_cache.kind("dynamic"):
        ref = regenerate(target, prompts, tmp_path / "d", max_new_tokens=16, batch_size=4, progress=False)
    assert ours["input_ids"] == ref["input_ids"]
    seen.clear()
    monkeypatch.setattr(target.model.generation_config, "cache_implementation", "static")
    regenerate(target, prompts[:2], tmp_path / "s", max_new_tokens=4, batch_size=2, progress=False)
    assert seen == [None]


def test_prose_prompts_open_comments_and_docstrings_of_training_files_only():
    from domino_lab.data.corpora import is_heldout_path
    from domino_lab.data.prose import candidates, prose_prompts

    rows = prose_prompts("train", 300)
    assert len(rows) == 300 and len({r["prompt"] for r in rows}) == 300
    assert {r["kind"] for r in rows} == {"comment", "doc"}
    assert not any(is_heldout_path(r["source"]) for r in rows)
    assert prose_prompts("train", 300) == rows and prose_prompts("train", 300, seed=1) != rows
    import random

    text = 'def f():\n    """Return the sum of two numbers given."""\n    # add them up and hand the result back\n'
    got = candidates([("m.py", text)], random.Random(0))
    assert {k for k, _, _ in got} == {"doc", "comment"}
    for kind, src, prompt in got:
        words = prompt.split()
        assert src == "m.py" and (prompt.startswith('"""Return') if kind == "doc" else words[:2] == ["#", "add"])
        assert 2 <= len(words) - (kind == "comment") <= (5 if kind == "doc" else 4)
    assert candidates([("m.py", "# short one\n")], random.Random(0)) == []   # too short to be prose
