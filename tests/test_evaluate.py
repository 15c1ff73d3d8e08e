"""τ over an eval set (domino_lab/evaluate.py) and the drafter comparison script built on it."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_samples_pool_several_sampling_seeds_per_prompt(target, monkeypatch):
    from domino_lab import Drafter, speculative_generate
    from domino_lab.errors import UserError
    from domino_lab.evaluate import evaluate

    d = Drafter.untrained(target, "dflash", seed=0, block_size=4)
    prompts = [{"id": f"p{i}", "prompt": None, "ids": ids} for i, ids in enumerate(([5, 9, 17], [40, 41, 42]))]
    one = [speculative_generate(target, d, prompt_ids=p["ids"], max_new_tokens=12, temperature=1.0, seed=s)
           for p in prompts for s in (3, 4)]
    # evaluate decodes text prompts; the tiny target has no tokenizer, so the prompt's id names its token ids
    import domino_lab.evaluate as ev

    orig = ev.speculative_generate
    ids = {p["id"]: p["ids"] for p in prompts}
    monkeypatch.setattr(ev, "speculative_generate",
                        lambda target, drafter, prompt, **kw: orig(target, drafter, prompt_ids=ids[prompt], **kw))
    res = evaluate(target, d, [{"id": p["id"], "prompt": p["id"]} for p in prompts], 12, 1.0, seed=3, samples=2)
    for row, pair in zip(res["per_prompt"], (one[:2], one[2:])):
        steps = [s for r in pair for s in r.steps]
        assert row["steps"] == len(steps)
        assert row["tau"] == pytest.approx(sum(s.acceptance_length for s in steps) / len(steps))
        assert row["tokens"] == sum(len(r.token_ids) for r in pair)
    all_steps = [s for r in one for s in r.steps]
    assert res["tau"] == pytest.approx(sum(s.acceptance_length for s in all_steps) / len(all_steps))
    with pytest.raises(UserError, match="samples=2: use 1, or more than 1 only with a temperature > 0"):
        evaluate(target, d, [], 12, 0.0, samples=2)


def test_gumbel_sampler_evaluates_every_drafter_on_plain_decodings_text(target, monkeypatch):
    from domino_lab import Drafter, speculative_generate
    from domino_lab.evaluate import evaluate
    import domino_lab.evaluate as ev

    prompts = {f"p{i}": ids for i, ids in enumerate(([5, 9, 17], [40, 41, 42], [7]))}
    orig = ev.speculative_generate
    monkeypatch.setattr(ev, "speculative_generate",
                        lambda target, drafter, prompt, **kw: orig(target, drafter, prompt_ids=prompts[prompt], **kw))
    plain = [speculative_generate(target, None, prompt_ids=ids, max_new_tokens=20, temperature=1.0, seed=5,
                                  sampler="gumbel").token_ids for ids in prompts.values()]
    rows = [{"id": k, "prompt": k} for k in prompts]
    for method in ("dflash", "domino"):
        d = Drafter.untrained(target, method, seed=0, block_size=4)
        res = evaluate(target, d, rows, 20, 1.0, seed=5, keep_ids=True, sampler="gumbel")
        assert [r["token_ids"] for r in res["per_prompt"]] == plain, method


def test_compare_drafters_script_with_samples(tmp_path):
    """Two sampling seeds per prompt; --sampler gumbel: both drafters sample plain decoding's text for each seed, so
    their rows count the same tokens on every prompt (with the rejection sampler each samples a text of its own)."""
    out = tmp_path / "cmp.json"
    base = [sys.executable, str(ROOT / "experiments" / "compare_drafters.py"), "--drafter", "domino=default",
            "--drafter", "dflash=default-dflash", "--sets", "humaneval", "--limit", "2", "--max-new-tokens", "40"]
    subprocess.run(base + ["--temperature", "1.0", "--samples", "2", "--sampler", "gumbel", "--out", str(out)],
                   check=True, capture_output=True, text=True, cwd=ROOT)
    saved = json.loads(out.read_text())
    # the shipped drafters were exported before training provenance was kept: the file names their specs only
    assert saved["drafters"] == {"domino": {"spec": "default"}, "dflash": {"spec": "default-dflash"}}
    res = saved["sets"]["humaneval"]
    assert [r["id"] for r in res["domino"]["per_prompt"]] == [r["id"] for r in res["dflash"]["per_prompt"]]
    assert res["paired_domino_vs_dflash"]["n"] == 2
    assert "--samples 2 --sampler gumbel" in out.with_suffix(".md").read_text()
    from domino_lab import Target, speculative_generate
    from domino_lab.data.eval_sets import load_eval_set

    target = Target.from_pretrained("default")
    plain = [sum(len(speculative_generate(target, None, prompt=p["prompt"], max_new_tokens=40, temperature=1.0,
                                          seed=k, sampler="gumbel").token_ids) for k in (0, 1))
             for p in load_eval_set("humaneval", limit=2)]
    for name in ("domino", "dflash"):
        assert [r["tokens"] for r in res[name]["per_prompt"]] == plain, name
    bad = subprocess.run(base + ["--samples", "2", "--out", str(tmp_path / "bad.json")], capture_output=True,
                         text=True, cwd=ROOT)
    assert bad.returncode != 0 and "only with a temperature > 0" in bad.stderr
    assert not (tmp_path / "bad.json").exists()


def test_compare_drafters_checks_every_greedy_output_against_plain_decoding(tmp_path, monkeypatch, capsys):
    """Greedy: each set is decoded once without a drafter and every drafter's output is compared with it, token for
    token (the "equal to plain" column, `lossless` in the JSON; the ids themselves are not kept). A drafter whose
    output differs makes the script say which, on which set, and exit 1, with the results still written."""
    out = tmp_path / "cmp.json"
    argv = ["--drafter", "domino=default", "--drafter", "off=default:head-off", "--sets", "humaneval", "--limit", "2",
            "--max-new-tokens", "24"]
    done = subprocess.run([sys.executable, str(ROOT / "experiments" / "compare_drafters.py"), *argv, "--out",
                           str(out)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    res = json.loads(out.read_text())["sets"]["humaneval"]
    for name in ("domino", "off"):
        assert res[name]["lossless"] == {"equal": 2, "total": 2, "mismatch_prompts": []}
        assert all("token_ids" not in row for row in res[name]["per_prompt"])
    assert out.with_suffix(".md").read_text().count("| 2/2 |") == 2

    cmp = _script("compare_drafters")
    real = cmp.evaluate

    def one_token_off(target, drafter, prompts, *a, **kw):
        r = real(target, drafter, prompts, *a, **kw)
        if drafter is not None and drafter.uses_head:          # "domino", not its head-off twin
            r["per_prompt"][1]["token_ids"] = r["per_prompt"][1]["token_ids"][:-1] + [0]
        return r

    monkeypatch.setattr(cmp, "evaluate", one_token_off)
    assert cmp.main([*argv, "--out", str(tmp_path / "bad.json")]) == 1
    err = capsys.readouterr().err
    assert "not lossless: domino on humaneval: 1 of 2 outputs differ" in err and "off on" not in err
    saved = json.loads((tmp_path / "bad.json").read_text())["sets"]["humaneval"]
    assert saved["domino"]["lossless"]["equal"] == 1 and saved["off"]["lossless"]["equal"] == 2


def test_named_drafters_take_inference_options_after_an_at_sign():
    """`NAME=SPEC[:head-off]@key=value,...` runs the drafter with those inference options (as the bench's --drafter
    does); the file's provenance keeps them; a bad option fails with one error before any drafter loads."""
    from domino_lab import Target
    from domino_lab.errors import UserError
    from domino_lab.evaluate import drafter_provenance, named_drafters

    target = Target.from_pretrained("default")
    items = ["full=default@candidate_pool=0,block_size=4", "off=default:head-off@candidate_pool=16", "plain=default"]
    ds = named_drafters(items, target)
    assert (ds["full"].options.candidate_pool, ds["full"].options.block_size) == (0, 4)
    assert ds["off"].options.candidate_pool == 16 and not ds["off"].head_enabled
    assert ds["plain"].options.candidate_pool == 64 and ds["plain"].head_enabled
    assert drafter_provenance(items)["off"]["spec"] == "default:head-off@candidate_pool=16"
    with pytest.raises(UserError, match="'pool=3' must be key=value with key one of"):
        named_drafters(["ok=default", "bad=no-such-drafter@pool=3"], target)


def _script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_first_draft_overlap_matches_the_drafting_path(target):
    """Slot 0's teacher-forced overlap is Σ min(p, q) with q what drafting samples the first draft from."""
    import torch
    import torch.nn.functional as F
    from transformers import DynamicCache

    from domino_lab import Drafter

    fdo = _script("first_draft_overlap")
    d = Drafter.untrained(target, "domino", seed=0, block_size=4)
    ids = [5, 9, 17, 40, 41, 42, 7, 12]
    a = len(ids) - 2                       # the one anchor whose first label is generated
    r = fdo.slot_overlap(target, d, [(ids, a)], temperature=1.0, anchors=4, seed=0)
    assert r["contexts"][0] == 1
    x = torch.tensor([ids])
    feats = target.features(x, d.config.target_layer_ids)
    draft = d.draft(feats[:, :a], 0, x[0, a:a + 1], a, DynamicCache(), n=1, temperature=1.0,
                    generator=torch.Generator().manual_seed(0))
    p = F.softmax(target.forward(x).logits[0, a].double(), -1)
    assert r["overlap"][0] == pytest.approx(torch.minimum(p, draft.q[0, 0].double()).sum().item(), rel=1e-6)
    assert 0 < r["overlap"][0] < 1


def test_first_draft_overlap_script(tmp_path):
    out = tmp_path / "o.json"
    cmd = [sys.executable, str(ROOT / "experiments" / "first_draft_overlap.py"), "--drafter", "domino=default",
           "--sets", "math", "--limit", "1", "--max-new-tokens", "12", "--anchors", "4", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    r = json.loads(out.read_text())["sets"]["math"]["domino"]
    assert len(r["overlap"]) == 8 and all(0 < v <= 1 for v in r["overlap"][:1])
    bad = subprocess.run(cmd[:-2] + ["--temperature", "0", "--out", str(tmp_path / "b.json")], capture_output=True,
                         text=True, cwd=ROOT)
    assert bad.returncode == 2 and "needs a temperature > 0" in bad.stderr and not (tmp_path / "b.json").exists()


def test_running_the_library_module_points_to_the_commands():
    import runpy
    import warnings

    with warnings.catch_warnings(), pytest.raises(SystemExit) as e:
        warnings.simplefilter("ignore", RuntimeWarning)          # runpy: the module is already imported
        runpy.run_module("domino_lab.evaluate", run_name="__main__")
    message = e.value.code
    assert isinstance(message, str) and "\n" not in message          # one line on stderr, exit status 1
    assert "experiments/compare_drafters.py" in message and "domino_lab.bench" in message
