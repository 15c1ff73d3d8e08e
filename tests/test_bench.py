"""Speculative inference as a LightningModule and `python -m domino_lab.bench`, on tiny targets."""
import json
import platform
from pathlib import Path

import pytest

from domino_lab import Drafter, Target, speculative_generate
from domino_lab.errors import run_cli
from core_helpers import make_target_dir


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    tdir = make_target_dir(root / "target", max_pos=256)
    # an assistant: same tokenizer, other (smaller) weights
    adir = make_target_dir(root / "assistant", hidden=16, max_pos=256, seed=3)
    target = Target.from_pretrained(str(tdir), dtype="float64")
    for method in ("domino", "dflash"):
        Drafter.untrained(target, method, seed=1).save_pretrained(root / method)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in
                               enumerate(["def add(a, b):", "Question: Tom has 3 apples", "return a +"])))
    return root, str(tdir), str(adir), str(prompts)


def test_predict_step_matches_the_engine(dirs):
    from domino_lab.inference import predict

    root, tdir, _, prompts = dirs
    target = Target.from_pretrained(tdir, dtype="float64")
    drafter = Drafter.from_pretrained(root / "domino", target)
    rows = predict(target, drafter, prompts, max_new_tokens=20, accelerator="cpu", devices=1, batch_size=2)
    assert [r["id"] for r in rows] == ["p0", "p1", "p2"]
    for r, text in zip(rows, ["def add(a, b):", "Question: Tom has 3 apples", "return a +"]):
        plain = speculative_generate(target, None, prompt=text, max_new_tokens=20).token_ids
        assert r["token_ids"] == plain            # lossless through Trainer.predict
        assert len(r["steps"]) == len(r["acceptance_lengths"]) > 0


def test_quick_bench_writes_table_json_and_checks_losslessness(dirs, tmp_path, capsys):
    from domino_lab.bench import main

    root, tdir, adir, prompts = dirs
    out = tmp_path / "bench"
    regime = tmp_path / "regime.json"          # the costs a regime map measured for two shapes
    regime.write_text(json.dumps({"results": {"A": {"step_ms": 10.0, "draft_8_ms": 2.0, "verify_8_ms": 18.0},
                                              "B": {"step_ms": 100.0, "draft_8_ms": 10.0, "verify_8_ms": 90.0}}}))
    argv = ["--target", tdir, "--dtype", "float64", "--sets", prompts, "--quick", "--out", str(out),
            "--domino", str(root / "domino"), "--dflash", str(root / "dflash"), "--assistant", adir,
            "--batch-sizes", "1", "2", "--batch-rounds", "2", "--candidate-pool", "0", "--mlflow", "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
            "--drafter", "chain=untrained:eagle",      # any registered method, under its own label
            "--drafter", f"d+cut={root / 'domino'}@draft_cutoff=0.4",   # with options of its own
            "--project", str(regime)]
    assert main(argv) == 0
    res = json.loads((out / "bench.json").read_text())["results"]["prompts"]
    methods = {"ar", "hf", "hf-prompt-lookup", "hf-assisted", "dflash", "domino-eager", "domino", "chain", "d+cut"}
    assert methods <= set(res)
    meta = json.loads((out / "bench.json").read_text())["meta"]
    bounds = json.loads((out / "bench.json").read_text())["projection"]["bounds"]["prompts"]
    assert set(bounds) == {"dflash", "domino", "d+cut"}         # chains of block drafters only (not eagle, not ar)
    assert bounds["domino"]["A"] == pytest.approx(res["domino"]["tau"] * 10.0 / 20.0)
    assert bounds["domino"]["B"] == pytest.approx(res["domino"]["tau"] * 100.0 / 100.0)
    assert "a projection, not a measurement" in (out / "bench.md").read_text()
    assert meta["options"]["d+cut"]["draft_cutoff"] == 0.4 and meta["options"]["domino"]["draft_cutoff"] == 0
    assert meta["dtype"] == "float64" and "; float64; greedy" in (out / "bench.md").read_text()
    # the code set comes from the running Python's standard library, so the report names the Python, and each set's
    # prompts by count and digest
    assert meta["machine"].endswith(f", Python {platform.python_version()}")
    # the models' weights beside the processor's last-level cache: whether both models of a decode fit in it
    target_mb = sum(p.numel() * p.element_size()
                    for p in Target.from_pretrained(tdir, dtype="float64").model.parameters())
    assert meta["weights_mb"]["target"] == pytest.approx(target_mb / 1e6, abs=0.01)
    assert set(meta["weights_mb"]) == {"target", f"drafter {root / 'domino'}", f"drafter {root / 'dflash'}",
                                       "drafter untrained:eagle"}
    assert f"Weights: target {target_mb / 1e6:.1f} MB, " in (out / "bench.md").read_text()
    from domino_lab.data.eval_sets import load_eval_set, prompts_digest

    given = load_eval_set(prompts)[:2]                  # --quick: the first 2 prompts of each set
    assert meta["prompts"] == {"prompts": prompts_digest(given)} and meta["prompts"]["prompts"]["n"] == 2
    assert f"prompts: prompts 2 (sha256 {prompts_digest(given)['sha256']})" in (out / "bench.md").read_text()
    assert prompts_digest([dict(given[0], prompt=given[0]["prompt"] + " "), given[1]]) != prompts_digest(given)
    for m in methods - {"ar"}:
        assert res[m]["lossless"]["equal"] == res[m]["lossless"]["total"] == 2, m
        assert res[m]["tokens_per_s"] > 0 and res[m]["speedup_vs_ar"] > 0
    target = Target.from_pretrained(tdir)
    for m in ("dflash", "domino", "domino-eager"):
        n = Drafter.from_pretrained(root / m.split("-")[0], target).config.num_drafts
        assert res[m]["tau"] >= 1 and len(res[m]["accept_pos"]) == n and res[m]["bound_vs_ar"] > 0
    assert res["hf"]["tau"] == pytest.approx(1.0)       # plain HF decoding: one token per forward
    # the eager reference head and the fast head draft the same tokens at K = 0 (--candidate-pool 0)
    assert res["domino-eager"]["tau"] == pytest.approx(res["domino"]["tau"])
    batched = json.loads((out / "bench.json").read_text())["batched"]["prompts"]
    for size in ("1", "2"):
        # the eagle chain does not batch (Drafter.supports_batched): batched rows are the block drafters only
        assert {m: r["lossless"] for m, r in batched[size].items()} == {"ar": 2, "dflash": 2, "domino": 2}
        for r in batched[size].values():       # two interleaved rounds; the reported speed is their median
            assert len(r["tokens_per_s_rounds"]) == 2 and min(r["tokens_per_s_rounds"]) <= r["tokens_per_s"]
    md = (out / "bench.md").read_text()
    assert "| hf-assisted |" in md and "equals `ar`" in md
    assert (out / "speedup.png").exists() and (out / "accept_pos.png").exists()
    # MLflow: one run with every method's numbers under bench/{set}/{method}/..., labels made valid keys
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("bench").experiment_id])
    assert run.data.metrics["bench/prompts/hf-prompt-lookup/tau"] == pytest.approx(res["hf-prompt-lookup"]["tau"])
    assert run.data.metrics["bench/prompts/d_cut/tokens_per_s"] == pytest.approx(res["d+cut"]["tokens_per_s"])
    assert run.data.params["drafter.d_cut"] == str(root / "domino")
    # the artifacts sit beside the store, not in ./mlruns of whatever directory the bench ran in
    assert run.info.artifact_uri.startswith((tmp_path / "mlartifacts" / "bench").as_uri())
    assert (tmp_path / "mlartifacts" / "bench" / run.info.run_id / "artifacts" / "bench.md").exists()


def test_sampled_bench_gumbel_checks_every_sample_against_ar(dirs, tmp_path):
    """T > 0 with the gumbel sampler: prompt i samples with seed + i in every method, so each of our decoders (chain,
    tree, batched) emits exactly plain decoding's sample; the hf methods sample on their own and are not compared."""
    from domino_lab.bench import main

    root, tdir, _, prompts = dirs
    out = tmp_path / "bench"
    argv = ["--target", tdir, "--dtype", "float64", "--sets", prompts, "--quick", "--limit", "3", "--out", str(out),
            "--domino", str(root / "domino"), "--dflash", str(root / "dflash"), "--methods", "ar", "hf", "dflash",
            "domino", "domino-tree", "--tree-nodes", "6", "--batch-sizes", "2", "--temperature", "1.5",
            "--top-p", "0.9", "--sampler", "gumbel", "--seed", "7"]
    assert main(argv) == 0
    doc = json.loads((out / "bench.json").read_text())
    res, batched = doc["results"]["prompts"], doc["batched"]["prompts"]["2"]
    assert doc["meta"]["sampling"] == {"temperature": 1.5, "top_p": 0.9, "sampler": "gumbel", "seed": 7}
    target = Target.from_pretrained(tdir, dtype="float64")
    texts = ["def add(a, b):", "Question: Tom has 3 apples", "return a +"]
    samples = [speculative_generate(target, None, prompt=t, max_new_tokens=16, temperature=1.5, top_p=0.9,
                                    sampler="gumbel", seed=7 + i).token_ids for i, t in enumerate(texts)]
    greedy = [speculative_generate(target, None, prompt=t, max_new_tokens=16).token_ids for t in texts]
    assert samples != greedy                                   # it sampled
    for m in ("dflash", "domino", "domino-tree"):
        assert res[m]["lossless"] == {"equal": 3, "total": 3, "mismatch_prompts": []}, m
    assert "lossless" not in res["hf"]                         # its own random stream: not compared
    # each prompt's sample is plain decoding's with seed 7 + its index, at batch 1 and in batches of 2
    assert sum(len(s) for s in samples) == res["ar"]["tokens"] == res["domino"]["tokens"]
    assert {m: r["lossless"] for m, r in batched.items()} == {"ar": 3, "dflash": 3, "domino": 3}
    from domino_lab.bench import Bench, Sampling

    b = Bench(target, ["ar", "domino"], {"domino": Drafter.from_pretrained(root / "domino", target)},
              max_new_tokens=16, sampling=Sampling(1.5, 0.9, "gumbel", 7))
    for i, t in enumerate(texts):
        assert b.run("domino", target.encode(t), i).tokens == b.run("ar", target.encode(t), i).tokens == samples[i]
    md = (out / "bench.md").read_text()
    assert "gumbel sampler, seed 7" in md and "samples exactly `ar`'s text" in md and "| prompts | hf |" in md


def test_bench_continuous_decodes_each_set_as_one_queue(dirs, tmp_path):
    """--continuous: each batch size is the slots of one queue over the set's prompts; every prompt's text (sampled
    here, seed + its index) equals plain decoding's, and the tables say how the batches were formed."""
    from domino_lab.bench import main

    root, tdir, _, prompts = dirs
    out = tmp_path / "bench"
    argv = ["--target", tdir, "--dtype", "float64", "--sets", prompts, "--quick", "--limit", "3", "--out", str(out),
            "--domino", str(root / "domino"), "--methods", "ar", "domino", "--batch-sizes", "2", "--continuous",
            "--temperature", "1.5", "--sampler", "gumbel", "--seed", "7"]
    assert main(argv) == 0
    doc = json.loads((out / "bench.json").read_text())
    assert doc["meta"]["batched_continuous"] is True
    assert {m: r["lossless"] for m, r in doc["batched"]["prompts"]["2"].items()} == {"ar": 3, "domino": 3}
    assert doc["results"]["prompts"]["domino"]["lossless"]["equal"] == 3
    assert "each set one queue through that many slots" in (out / "bench.md").read_text()


def test_sampled_bench_rejection_compares_nothing_token_for_token(dirs, tmp_path):
    from domino_lab.bench import main

    root, tdir, _, prompts = dirs
    out = tmp_path / "bench"
    assert main(["--target", tdir, "--dtype", "float64", "--sets", prompts, "--quick", "--out", str(out),
                 "--domino", str(root / "domino"), "--methods", "ar", "domino", "--temperature", "1"]) == 0
    res = json.loads((out / "bench.json").read_text())["results"]["prompts"]
    assert "lossless" not in res["domino"] and res["domino"]["tau"] >= 1
    md = (out / "bench.md").read_text()
    assert "rejection sampler" in md and "not compared token for token" in md
    assert "| prompts | domino |" in md and " | – | " in md.split("| prompts | domino |")[1].splitlines()[0]


def test_bench_bad_input_is_one_clear_line(dirs, tmp_path, capsys):
    from domino_lab.bench import main

    root, tdir, _, prompts = dirs
    for argv, msg in ((["--sets", "nope"], "nope"),
                      (["--sets", prompts, "--target", tdir, "--methods", "ar", "hf-assisted", "--assistant",
                        str(tmp_path / "missing")], "assistant"),
                      (["--max-new-tokens", "0"], "--max-new-tokens"),
                      (["--batch-sizes", "4", "--batch-rounds", "0"], "--batch-rounds"),
                      (["--sets", prompts, "--target", tdir, "--drafter", "domino=untrained:eagle"], "LABEL=SPEC"),
                      (["--sets", prompts, "--target", tdir, "--methods", "ar", "--drafter", "x=untrained:domino@cut=1"],
                       "key one of"),
                      (["--sets", prompts, "--target", tdir, "--methods", "ar", "--project", prompts],
                       "not a regime map"),
                      (["--sets", prompts, "--target", tdir, "--methods", "ar", "--project", str(tmp_path / "no.json")],
                       "no.json: cannot read it (No such file or directory)"),
                      (["--sets", prompts, "--target", tdir, "--methods", "ar", "--drafter", "x=untrained:nope"],
                       "unknown drafter method"),
                      (["--sets", prompts, "--target", tdir, "--methods", "ar", "--drafter",
                        "x=untrained:domino@lookup=3,tree_min_prob=0.05"], "tree_min_prob shapes a draft tree"),
                      (["--sets", prompts, "--temperature", "-1"], "temperature must be a finite number >= 0"),
                      (["--sets", prompts, "--temperature", "nan"], "temperature must be a finite number >= 0"),
                      (["--sets", prompts, "--temperature", "1", "--top-p", "1.5"], "top_p in (0, 1]"),
                      (["--sets", prompts, "--temperature", "1", "--batch-sizes", "2"], "--sampler gumbel"),
                      (["--sets", prompts, "--temperature", "1", "--sampler", "gumbel", "--tree-sampled"],
                       "sampled trees"),
                      (["--sets", prompts, "--seed", "-1"], "--seed")):
        with pytest.raises(SystemExit) as e:
            run_cli(main, argv + ["--out", str(tmp_path / "o")])
        err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
        assert e.value.code == 2 and len(err) == 1 and msg in err[0], err
    assert not (tmp_path / "o").exists()


def test_predict_data_parallel_two_cpu_processes(dirs, tmp_path):
    """`Trainer.predict` under DDP (gloo, 2 CPU processes): each rank decodes its share; together all prompts."""
    import os
    import subprocess
    import sys

    root, tdir, _, prompts = dirs
    out = tmp_path / "pred.jsonl"
    q = subprocess.run([sys.executable, "-m", "domino_lab.inference", "--target", tdir, "--drafter",
                        str(root / "domino"), "--prompts", prompts, "--out", str(out), "--max-new-tokens", "12",
                        "--accelerator", "cpu", "--devices", "2", "--strategy", "ddp", "--dtype", "float64"],
                       capture_output=True, text=True, timeout=400, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert q.returncode == 0, q.stderr[-3000:]
    rows = [json.loads(x) for f in (out, tmp_path / "pred.rank1.jsonl") for x in f.read_text().splitlines()]
    assert {r["rank"] for r in rows} == {0, 1}
    assert {r["id"] for r in rows} == {"p0", "p1", "p2"}     # the sampler pads 3 prompts to 2 x 2
    target = Target.from_pretrained(tdir, dtype="float64")
    texts = {json.loads(x)["id"]: json.loads(x)["prompt"] for x in Path(prompts).read_text().splitlines()}
    for r in rows:
        assert r["token_ids"] == speculative_generate(target, None, prompt=texts[r["id"]], max_new_tokens=12).token_ids


def test_predict_batched_matches_one_at_a_time(dirs):
    """--batched decodes a Lightning batch's prompts together: the same tokens (greedy, and gumbel-sampled with
    the same per-row seeds) as one prompt at a time, without per-step records; what it cannot do is one error."""
    from domino_lab.errors import UserError
    from domino_lab.inference import predict

    from domino_lab.models import InferenceOptions

    root, tdir, _, prompts = dirs
    target = Target.from_pretrained(tdir, dtype="float64")
    drafter = Drafter.from_pretrained(root / "domino", target)
    cutoff = InferenceOptions(draft_cutoff=0.3)
    for kw in ({}, {"temperature": 1.0, "sampler": "gumbel", "seed": 5}):
        # one prompt per Lightning batch: a prompt's seed is its place in the prompts, whatever the batch size
        one = predict(target, drafter, prompts, max_new_tokens=16, accelerator="cpu", devices=1, batch_size=1,
                      steps=False, **kw)
        together = predict(target, drafter, prompts, max_new_tokens=16, accelerator="cpu", devices=1, batch_size=2,
                           steps=False, batched=True, **kw)
        assert [r["id"] for r in together] == ["p0", "p1", "p2"]
        for a, b in zip(one, together):
            assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"], kw
            assert a["stop_reason"] == b["stop_reason"]
            assert sum(b["acceptance_lengths"]) + 1 == len(b["token_ids"]) == b["num_new_tokens"]
            assert "steps" not in b
        assert [r["batch_size"] for r in together] == [2, 2, 1]
        # all three prompts in one Lightning batch, decoded as a queue through 2 slots: the same tokens again
        queued = predict(target, drafter, prompts, max_new_tokens=16, accelerator="cpu", devices=1, batch_size=3,
                         steps=False, batched=True, slots=2, **kw)
        assert [r["token_ids"] for r in queued] == [r["token_ids"] for r in one], kw
        assert [(r["batch_size"], r["slots"]) for r in queued] == [(3, 2)] * 3
    # the one-at-a-time path samples the same whatever the batch size (rejection sampling too)
    a, b = (predict(target, drafter, prompts, max_new_tokens=12, accelerator="cpu", devices=1, batch_size=size,
                    steps=False, temperature=1.0, seed=3) for size in (1, 2))
    assert [r["token_ids"] for r in a] == [r["token_ids"] for r in b]
    from domino_lab.decoding.batched import batched_generate
    with pytest.raises(UserError, match="row_seeds"):
        batched_generate(target, drafter, [[5, 6], [7]], 4, temperature=1.0, sampler="gumbel", row_seeds=[1])
    for bad, match in (({"slots": 0}, "slots must be"), ({"slots": 2, "batched": False}, "add --batched"),
                       ({"tree_nodes": 4}, "tree"), ({"temperature": 1.0}, "gumbel"), ({"steps": True}, "records"),
                       ({"block_size": 4}, "block"), ({"drafter": str(root / "domino"), "options": cutoff}, "cutoff")):
        kw = {"drafter": drafter, "steps": False} | bad
        with pytest.raises(UserError, match=match):
            predict(target, prompts=prompts, max_new_tokens=4, accelerator="cpu", devices=1, **({"batched": True} | kw))


def test_inference_cli_batched(dirs, tmp_path, capsys):
    from domino_lab.errors import UserError
    from domino_lab.inference import main

    root, tdir, _, prompts = dirs
    out = tmp_path / "pred.jsonl"
    base = ["--target", tdir, "--dtype", "float64", "--drafter", str(root / "domino"), "--prompts", prompts,
            "--max-new-tokens", "8", "--accelerator", "cpu", "--devices", "1", "--threads", "1"]
    assert main(base + ["--out", str(out), "--batched", "--batch-size", "3"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["batch_size"] for r in rows] == [3, 3, 3] and all("steps" not in r for r in rows)
    with pytest.raises(UserError, match="tree"):
        main(base + ["--out", str(tmp_path / "bad.jsonl"), "--batched", "--tree-nodes", "4"])
    assert main(base + ["--out", str(out), "--batched", "--batch-size", "3", "--slots", "2"]) == 0
    assert [json.loads(x)["slots"] for x in out.read_text().splitlines()] == [2, 2, 2]
    with pytest.raises(UserError, match="without --batched"):
        main(base + ["--out", str(tmp_path / "bad.jsonl"), "--slots", "2"])
    with pytest.raises(UserError, match="--batch-size must be at least 1"):
        main(base + ["--out", str(tmp_path / "bad.jsonl"), "--batch-size", "0"])
    assert not (tmp_path / "bad.jsonl").exists()


def test_default_methods_skip_what_the_target_cannot_run(dirs, tmp_path, capsys):
    """A target with linear-attention layers: trees cannot verify on it and the shipped assistant shares no
    vocabulary with it. Left to its defaults the bench runs every other method and says what it skipped; naming a
    method it cannot run is one error line."""
    import shutil

    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from domino_lab.bench import main

    root, tdir, _, prompts = dirs
    hdir = tmp_path / "hybrid"
    shutil.copytree(tdir, hdir, ignore=shutil.ignore_patterns("model.safetensors", "config.json"))
    vocab = Target.from_pretrained(tdir).vocab_size
    torch.manual_seed(0)
    Qwen3NextForCausalLM(Qwen3NextConfig(
        vocab_size=vocab, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=64, mlp_only_layers=[0, 1, 2, 3], linear_num_value_heads=2,
        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, max_position_embeddings=256,
        eos_token_id=Target.from_pretrained(tdir).tokenizer.eos_token_id)).save_pretrained(hdir)
    target = Target.from_pretrained(str(hdir), dtype="float64")
    for method in ("domino", "dflash"):
        Drafter.untrained(target, method, seed=1).save_pretrained(tmp_path / method)
    common = ["--target", str(hdir), "--dtype", "float64", "--sets", prompts, "--quick", "--domino",
              str(tmp_path / "domino"), "--dflash", str(tmp_path / "dflash")]
    out = tmp_path / "bench"
    assert main(common + ["--out", str(out)]) == 0
    doc = json.loads((out / "bench.json").read_text())
    res, skipped = doc["results"]["prompts"], doc["meta"]["skipped"]
    assert set(skipped) == {"dflash-tree", "domino-tree", "hf-assisted"}
    assert "LinearAttentionLayer" in skipped["domino-tree"] and "vocabulary" in skipped["hf-assisted"]
    assert {"ar", "hf", "hf-prompt-lookup", "dflash", "domino-eager", "domino-fast", "domino"} == {m for m in res if not m.startswith("_")}
    for m in ("dflash", "domino", "domino-eager"):
        assert res[m]["lossless"]["equal"] == res[m]["lossless"]["total"] == 2, m
    assert "Skipped `domino-tree`" in (out / "bench.md").read_text()
    assert "skipping dflash-tree" in capsys.readouterr().err

    with pytest.raises(SystemExit) as e:
        run_cli(main, common[:-2] + ["--out", str(tmp_path / "named"), "--methods", "ar", "domino-tree"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "LinearAttentionLayer" in err[0]
    assert not (tmp_path / "named").exists()


def test_weights_line_names_the_cache_or_its_absence():
    from domino_lab.bench import weights_line

    assert weights_line({"target": 27.28, "drafter default": 11.17}, (3, 32.0)) == (
        "Weights: target 27.3 MB, drafter default 11.2 MB; this processor's last-level cache (L3) holds 32 MB "
        "(docs/design.md#cpu-caches).")
    assert "the OS reports no cache size" in weights_line({"target": 1.0}, None)


def test_bench_records_the_kernels_and_head_reads_it_used(tmp_path):
    """Which LM-head read each kind of greedy call took and which weight shapes took oneDNN's packed product are
    timed per process, so the run's record names them (json and the report's header line)."""
    from domino_lab.bench import main
    from domino_lab.models import packed_linear as pl

    out = tmp_path / "b"
    assert main(["--sets", "humaneval", "--limit", "1", "--max-new-tokens", "8", "--methods", "ar", "domino",
                 "--threads", "1", "--out", str(out)]) == 0
    meta = json.loads((out / "bench.json").read_text())["meta"]
    assert meta["lm_head_reads"]["1 row"] in ("screen", "full")          # the plain steps' read
    assert meta["lm_head_reads"]["2-16 rows"] in ("screen", "full")      # the verifies'
    kernels = meta["linear_kernels"]
    assert kernels["mode"] == pl.mode()
    if pl.available() and kernels["mode"] == "auto":
        assert "8192x256" in kernels["packed_from"]          # the embedded target's LM head, measured in this run
    header = (out / "bench.md").read_text().splitlines()[2]
    assert f"linear kernels: {pl.describe(kernels)}" in header and "greedy LM head: screen (1 row: " in header


def test_the_kernel_record_reads_as_one_line():
    from domino_lab.models import packed_linear as pl

    c = {"mode": "auto", "packed_from": {"256x256": None, "768x256": 9, "8192x256": 1}}
    assert pl.describe(c) == "auto (oneDNN packed: 768x256 from 9 rows, 8192x256 from 1 row; MKL: 256x256)"
    assert pl.describe({"mode": "aten", "packed_from": {}}) == "aten"
    assert pl.describe({"mode": "auto", "packed_from": {}}) == "auto"
    assert set(pl.choices()) == {"mode", "packed_from"}
