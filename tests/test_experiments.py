"""The experiment runner (`python -m domino_lab.experiments`): every committed spec runs end to end in --quick
mode on the embedded default (a few training steps, 2 prompts per set), its tables say what the spec asks, and
bad specs fail with one line and write nothing."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from domino_lab.errors import UserError
from domino_lab.experiments.__main__ import main
from domino_lab.experiments.spec import available, load_spec, parse_spec

ROOT = Path(__file__).resolve().parents[1]
SPECS = ["head_ablation", "training_ablation", "block_size", "same_data", "sensitivity", "lookup", "draft_layers"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """One runs folder for the module: runs are shared by name across experiments, as in real use."""
    return tmp_path_factory.mktemp("experiments")


def run_quick(work: Path, name: str) -> dict:
    argv = ["run", name, "--quick", "--no-progress", "--out-dir", str(work / "results"), "--runs-dir",
            str(work / "runs"), "--tracking-uri", f"sqlite:///{work / 'mlflow.db'}"]
    assert main(argv) == 0
    md = (work / "results" / f"{name}.md").read_text()
    data = json.loads((work / "results" / f"{name}.json").read_text())
    return {"md": md, **data}


def test_committed_specs_are_the_seven_experiments():
    assert sorted(SPECS) == available()
    for n in SPECS:
        spec = load_spec(n)
        assert spec.variants[0].name == "ar"          # every table carries its plain-decoding reference
        assert (ROOT / "experiments" / "results" / f"{n}.md").exists(), f"{n}: no committed result table"


@pytest.mark.parametrize("name", SPECS)
def test_quick_run(work, name):
    spec = load_spec(name)
    out = run_quick(work, name)
    res = out["results"]
    assert list(res) == spec.sets
    for s in spec.sets:
        assert list(res[s]) == [str(t) for t in spec.temperatures]
        for temp, cell in res[s].items():
            expected = [v.name for v in spec.variants
                        if (not v.sets or s in v.sets) and (v.temperatures is None or float(temp) in v.temperatures)]
            assert list(cell) == expected
            for v, per_seed in cell.items():
                for r in per_seed.values():
                    assert r["n_prompts"] == 2 and r["tau"] >= 1.0 and r["speedup"] > 0
                    if float(temp) == 0.0:
                        assert r["lossless"] == 2, f"{name} {s} {v}: greedy output differs from the target's"
                    if v == "ar":
                        assert r["tau"] == 1.0
    md = out["md"]
    from domino_lab.data.eval_sets import load_eval_set, prompts_digest, prompts_line
    digests = {s: prompts_digest(load_eval_set(s, limit=2)) for s in spec.sets}     # what --quick measured
    assert out["meta"]["prompts"] == digests and f" Prompts: {prompts_line(digests)}." in md
    # `report` re-renders the same markdown from the JSON alone (how a reading is added after a run)
    assert main(["report", name, "--out-dir", str(work / "results")]) == 0
    assert (work / "results" / f"{name}.md").read_text() == md
    assert md.startswith(f"# {spec.title}") and "python -m domino_lab.experiments run" in md
    for v in spec.variants:
        assert f"| {v.name} |" in md
    if "head_overhead" in spec.extras:
        assert set(out["extras"]["head_overhead"]) == {v.name for v in spec.variants if v.run and v.head}
        assert "Domino head cost per draft step" in md
    if "base_loss" in spec.extras:
        assert (work / "results" / f"{name}_base_loss.png").stat().st_size > 1000
        curves = out["extras"]["base_loss"]["curves"]
        assert set(curves) == {v.run for v in spec.variants if v.run} and all(c["values"] for c in curves.values())
    if name == "same_data":     # FR-Spec rows: only on greedy math, draft vocabulary K as asked
        assert "domino+fr512" in res["math"]["0.0"] and "domino+fr512" not in res["math"]["1.0"]
        assert "| domino − dflash | code | 1.0 |" in md
    if name == "block_size":
        assert "| domino-b16 | 16 |" in md and "| dflash-b4 | 4 |" in md


def test_gumbel_sampler_spec_checks_sampled_outputs(work, tmp_path):
    """`sampler: gumbel` at T > 0: every variant samples plain decoding's text for a seed, so the table checks it
    token for token, as it does greedy output."""
    spec = tmp_path / "sampled.yaml"
    spec.write_text(yaml.safe_dump({"title": "Sampled", "runs": {"domino": {"recipe": "domino"}},
                                    "variants": [{"name": "ar"}, {"name": "domino", "run": "domino"},
                                                 {"name": "domino-off", "run": "domino", "head": False}],
                                    "sets": ["math"], "temperatures": [1.0], "sampler": "gumbel"}))
    argv = ["run", str(spec), "--quick", "--no-progress", "--out-dir", str(work / "results"), "--runs-dir",
            str(work / "runs"), "--tracking-uri", f"sqlite:///{work / 'mlflow.db'}"]
    assert main(argv) == 0
    cell = json.loads((work / "results" / "sampled.json").read_text())["results"]["math"]["1.0"]
    for v in ("ar", "domino", "domino-off"):
        assert cell[v]["0"]["lossless"] == 2, v
    md = (work / "results" / "sampled.md").read_text()
    assert "### math, T=1.0, gumbel sampler" in md and "the gumbel sampler at T > 0" in md
    assert "| domino | 1 |" in md and "| 2/2 |" in md
    with pytest.raises(UserError, match="unknown sampler"):
        parse_spec({**yaml.safe_load(spec.read_text()), "sampler": "nope"}, "bad", "t.yaml")


def test_runs_are_reused_not_retrained(work):
    """A second run of the same experiment trains nothing (shared runs by name) and reports that."""
    out = run_quick(work, "head_ablation")
    assert out["meta"]["trained"] == "none (all reused)"


def test_bad_specs_fail_with_one_line(tmp_path):
    with pytest.raises(UserError, match="no experiment 'nope'"):
        load_spec("nope")
    base = {"title": "t", "runs": {"a": {"recipe": "domino"}}, "variants": [{"name": "ar"}, {"name": "x", "run": "a"}]}
    parse_spec(base, "ok", "t.yaml")
    for bad, msg in [({"variants": [{"name": "x", "run": "missing"}]}, "not under runs"),
                     ({"runs": {"a": {"recipe": "domino", "sweep": "s.yaml"}}}, "exactly one of"),
                     ({"sets": ["gsm8k"]}, "unknown eval set"),
                     ({"compare": [["x", "nope"]]}, "pairs of variant names"),
                     ({"extras": ["plots"]}, "unknown extras"),
                     ({"lmit": 3}, "unknown key"),
                     ({"variants": [{"name": "ar", "frspec_k": 8}]}, "no run")]:
        with pytest.raises(UserError, match=msg):
            parse_spec({**base, **bad}, "bad", "t.yaml")
    # the CLI: one error line, non-zero exit, nothing written
    spec = tmp_path / "broken.yaml"
    spec.write_text(yaml.safe_dump({**base, "sets": ["gsm8k"]}))
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "domino_lab.experiments", "run", str(spec), "--out-dir", str(out)],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode != 0 and p.stderr.strip().count("\n") == 0 and "unknown eval set 'gsm8k'" in p.stderr
    assert not out.exists()


def test_command_line_overrides(tmp_path):
    """key=value after the name reaches every run (e.g. another target) in its own folders; a bad one fails first,
    creating nothing."""
    from domino_lab.experiments.training import resolve_runs

    spec = load_spec("block_size")
    plain = resolve_runs(spec, tmp_path / "r", quick=False)
    other = resolve_runs(spec, tmp_path / "r", quick=False, extra=["max_steps=50", "loss.gamma=3"])
    assert len(plain) == len(other) == 6
    for (r, seed, a, _), (_, _, b, _) in zip(plain, other):
        assert a.out_dir != b.out_dir and Path(b.out_dir).name.startswith(f"{r.name}-s{seed}-")
        assert (b.max_steps, b.loss.gamma) == (50, 3) and b.drafter.block_size == a.drafter.block_size
    p = subprocess.run([sys.executable, "-m", "domino_lab.experiments", "run", "head_ablation", "bogus=1", "--quick",
                        "--runs-dir", str(tmp_path / "runs"), "--out-dir", str(tmp_path / "out")],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode != 0 and "unknown config key 'bogus'" in p.stderr and p.stderr.strip().count("\n") == 0
    assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()


def test_seed_summary_joins_runs_of_one_seed_and_pairs_on_common_sets(tmp_path):
    """`A.json+B.json` merges two invocations of one seed; a pair is summarised on the sets both drafters were
    measured on in every seed, and a pair measured nowhere is one clear error."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))
    import seed_summary

    def run(name, taus, sets):
        def rows(s):
            return [{"id": f"{s}/{i}", "tau": t, "steps": 4} for i, t in enumerate(taus)]
        return {"sets": {s: {name: {"tau": sum(taus) / len(taus), "per_prompt": rows(s)}} for s in sets}}

    files = []
    for seed in range(2):
        a, b = tmp_path / f"a{seed}.json", tmp_path / f"b{seed}.json"
        a.write_text(json.dumps(run("new", [3.0 + seed, 4.0, 5.0], ["math", "code"])))
        b.write_text(json.dumps(run("old", [2.0, 3.0 + seed, 4.0], ["math"])))
        files.append(f"{a}+{b}")
    out = tmp_path / "s.md"
    assert seed_summary.main(["--runs", *files, "--pair", "new", "old", "--out", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())["new_vs_old"]
    assert list(res) == ["math"] and res["math"]["n"] == 6 and res["math"]["pooled_diff"] == pytest.approx(1.0)
    with pytest.raises(UserError, match="no eval set has drafters"):
        seed_summary.main(["--runs", *files, "--pair", "new", "nope", "--out", str(out)])
    # drafters that record different training data are summarised, with a note naming the seed and both digests
    for seed, digest in ((0, "aaaa"), (1, "bbbb")):
        a = tmp_path / f"a{seed}.json"
        a.write_text(json.dumps(dict(json.loads(a.read_text()), drafters={"new": {"spec": "x", "data_digest": digest}})))
        b = tmp_path / f"b{seed}.json"
        b.write_text(json.dumps(dict(json.loads(b.read_text()), drafters={"old": {"spec": "y", "data_digest": "aaaa"}})))
    assert seed_summary.main(["--runs", *files, "--pair", "new", "old", "--out", str(out)]) == 0
    notes = [x for x in out.read_text().splitlines() if x.startswith("Note:")]
    assert notes == ["Note: seed run 1: new was trained on data bbbb, old on aaaa."]
    # one recipe labelled differently per seed pools under one name with --rename
    c = tmp_path / "c.json"
    c.write_text(json.dumps(run("newer", [9.0, 9.0, 9.0], ["math"])))
    files.append(f"{c}+{tmp_path / 'b0.json'}")
    assert seed_summary.main(["--runs", *files, "--rename", "newer=new", "--pair", "new", "old",
                              "--out", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())["new_vs_old"]["math"]
    assert res["n"] == 9 and len(res["ratios"]) == 3 and res["ratios"][2] == pytest.approx(9.0 / 3.0)
    with pytest.raises(UserError, match="OLD=NEW"):
        seed_summary.main(["--runs", *files, "--rename", "newer", "--pair", "new", "old", "--out", str(out)])


def test_engine_overhead_pairs_bare_and_engine_per_prompt():
    """The overhead script's measurement in-process (no child processes, no profiler): every prompt is measured
    `repeats` times both ways and the paired ratios are what the report's 'paired' columns show."""
    import argparse
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "experiments" / "engine_overhead.py"
    spec = importlib.util.spec_from_file_location("engine_overhead", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    args = argparse.Namespace(quick=True, threads=1, drafters=["domino"], sets=["math"], limit=1, max_new_tokens=12,
                              repeats=2, omp_policies=["default"])
    res = mod.measure(args)
    rows = res["per_prompt_ms"]
    assert res["prompts"] == 1 and len(rows["engine_step_paired"]) == len(rows["engine_verify_paired"]) == 1
    for i, ratio in enumerate(rows["engine_step_paired"]):
        assert ratio == pytest.approx(rows["engine_step"][i] / rows["bare_step_mean"][i])
    md = mod.report({"argv": [], "machine": "x", "date": "d", "prompts": 1, "policies": {"default": res}}, args, "")
    assert "| paired |" in md and f"{res['median_ms']['engine_step_paired']:.2f}×" in md


def test_draft_floor_times_the_draft_step_and_its_parts(tmp_path):
    """The draft-floor script times every part on one context and reports each against the plain step."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "experiments" / "draft_floor.py"
    spec = importlib.util.spec_from_file_location("draft_floor", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "floor"
    assert mod.main(["--quick", "--no-compile", "--out", str(out)]) == 0
    ms = json.loads((out / "draft_floor.json").read_text())["ms"]
    # (the shipped drafter reads copy candidates: the host work of computing them in a decoding step is timed too)
    assert set(ms) == {"plain step", "draft step", "backbone (eager)", "matmuls", "matmuls, weights in cache",
                       "lm head", "copy input host work (7 new tokens)"}
    assert all(v > 0 for v in ms.values())
    assert "| matmuls |" in (out / "draft_floor.md").read_text()
    assert "with their weights in the cache, the matmuls take" in (out / "draft_floor.md").read_text()
    assert "each draft step also pays the copy input's host work" in (out / "draft_floor.md").read_text()


def test_train_step_bench_times_every_mode(tmp_path):
    """The training-step benchmark runs each (features, precision) mode on the same batches and reports them all."""
    import importlib.util

    from core_helpers import make_regenerated

    tdir, data = make_regenerated(tmp_path / "tiny", n_prompts=16, max_new_tokens=24)
    path = Path(__file__).resolve().parents[1] / "experiments" / "train_step_bench.py"
    spec = importlib.util.spec_from_file_location("train_step_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "step.md"
    assert mod.main(["--data", data, "--features-dir", str(tmp_path / "feats"), "--steps", "2", "--rounds", "2",
                     "--threads", "1", "--out", str(out), f"target={tdir}", "drafter.gru_hidden=16",
                     "drafter.rank=8", "loss.num_anchors=8"]) == 0
    rows = [r for r in out.read_text().splitlines() if r.startswith("| o")]
    online, offline = "online (the target's decoder inside every step)", "offline (memory-mapped fp16 cache)"
    assert [tuple(c.strip() for c in r.split("|")[1:3]) for r in rows] == [
        (online, "32-true"), (offline, "32-true"), (online, "bf16-mixed"), (offline, "bf16-mixed")]
    assert all(float(r.split("|")[3]) > 0 for r in rows)


def test_regime_map_times_chains_and_trees_and_projects_the_tree_gain(tmp_path):
    """The regime map on two tiny shapes: every quantity timed, the tree's cost ratio is what its times say, and the
    tree section turns a tree result's τ gain into tokens per second through that ratio; a bad budget is one error."""
    import importlib.util

    from domino_lab.errors import UserError

    path = Path(__file__).resolve().parents[1] / "experiments" / "regime_map.py"
    spec = importlib.util.spec_from_file_location("regime_map", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    tree = tmp_path / "tree.json"
    tree.write_text(json.dumps({"results": {"math": {"domino@0": {"tau": 4.0}, "domino@16": {"tau": 5.0}}}}))
    out = tmp_path / "map"
    assert mod.main(["--quick", "--tree-nodes", "16", "--tree", str(tree), "--bench", str(tmp_path / "none.json"),
                     "--out", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    assert res["tree_tau_gain"] == {"math": pytest.approx(1.25)}
    md = out.with_suffix(".md").read_text()
    for name, r in res["results"].items():
        assert r["tree_nodes"] == 16 and min(r[k] for k in r if k.endswith("_ms")) > 0
        ratio = (r["draft_tree_ms"] + r["verify_tree_ms"]) / (r["draft_8_ms"] + r["verify_8_ms"])
        assert r["tree_cost_ratio"] == pytest.approx(ratio)
        assert f"| {ratio:.2f} | {1.25 / ratio:.2f}× |" in md
    with pytest.raises(UserError, match="--tree-nodes"):
        mod.main(["--quick", "--tree-nodes", "-1", "--out", str(tmp_path / "bad")])
    assert not (tmp_path / "bad.md").exists()


def test_regime_map_in_bfloat16_into_a_new_folder(tmp_path):
    """--dtype bfloat16 times targets and drafters in bfloat16 (the dtype is recorded with the CPU's bf16 units), and
    a --out stem in a folder that does not exist yet gets its table, JSON and plot there."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "experiments" / "regime_map.py"
    spec = importlib.util.spec_from_file_location("regime_map_bf16", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "new" / "map"
    assert mod.main(["--quick", "--dtype", "bfloat16", "--tree-nodes", "0", "--bench", str(tmp_path / "none.json"),
                     "--out", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    assert res["meta"]["dtype"] == "bfloat16" and "bfloat16" in res["meta"]["machine"]
    assert all(min(r[k] for k in r if k.endswith("_ms")) > 0 for r in res["results"].values())
    assert out.with_suffix(".png").stat().st_size > 0 and "the fast head" in out.with_suffix(".md").read_text()


def test_prose_prompts_script_writes_the_library_prompts(tmp_path):
    """experiments/prose_prompts.py writes `domino_lab.data.prose.prose_prompts` as JSONL (the prose-data experiment's
    data); bad input is one error line."""
    import importlib.util
    import json

    from domino_lab.data.prose import prose_prompts
    from domino_lab.errors import UserError

    path = Path(__file__).resolve().parents[1] / "experiments" / "prose_prompts.py"
    spec = importlib.util.spec_from_file_location("prose_prompts_script", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "p.jsonl"
    mod.main(["--n", "50", "--out", str(out)])
    assert [json.loads(line) for line in out.read_text().splitlines()] == prose_prompts("train", 50)
    with pytest.raises(UserError, match="--n must be"):
        mod.main(["--n", "0", "--out", str(tmp_path / "q.jsonl")])
    assert not (tmp_path / "q.jsonl").exists()


def test_ship_copies_each_recipes_best_drafter_and_keeps_a_warm_started_list(tmp_path, monkeypatch):
    """experiments/train_default_drafters.py --ship-only: a stage-2 recipe's drafter ships with the FR-Spec list it
    was warm-started with and a README naming its source; a stage-1 drafter without a list ships unrestricted with
    --frspec-k 0. Assets go under the script's ROOT (here a temporary folder)."""
    import importlib.util

    from safetensors.torch import load_file

    from domino_lab import Drafter, Target
    from domino_lab.models import load_drafter

    path = ROOT / "experiments" / "train_default_drafters.py"
    spec = importlib.util.spec_from_file_location("train_default_drafters", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "ROOT", tmp_path)
    target = Target.from_pretrained("default")
    runs = tmp_path / "runs"
    sources = {"domino_prose": load_drafter("default", target),                 # carries a 1,024-token list
               "domino_copy": Drafter.untrained(target, "domino", seed=1)}      # no list
    for recipe, d in sources.items():
        d.save_pretrained(runs / f"{recipe}-s0" / "best")
        (runs / f"{recipe}-s0" / "result.json").write_text(json.dumps({"steps": 7, "best_tau": 2.5}))
    assert mod.main(["--recipes", "domino_prose", "domino_copy", "--seeds", "0", "--runs-dir", str(runs),
                     "--ship-only", "--frspec-k", "0"]) == 0

    assets = tmp_path / "domino_lab" / "assets"
    shipped = load_file(assets / "drafter-domino-prose" / "model.safetensors")
    source = load_file(runs / "domino_prose-s0" / "best" / "model.safetensors")
    assert set(shipped) == set(source) and all(shipped[k].equal(source[k]) for k in source)
    readme = (assets / "drafter-domino-prose" / "README.md").read_text()
    assert readme.startswith("# `default` drafter (domino_prose)")
    assert "from the shipped `default-mc`" in readme and "warm-started with" in readme and "prose_data.md" in readme
    plain = (assets / "drafter-domino-copy" / "README.md").read_text()
    assert plain.startswith("# `default-mc` drafter (domino_copy)") and "FR-Spec" not in plain
    assert Drafter.from_pretrained(assets / "drafter-domino-copy", target).config.frspec_k == 0
