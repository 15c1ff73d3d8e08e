"""experiments/speed_pair.py: two drafters decode the same prompts in alternating order; the per-prompt ratio is
their wall-time ratio, summarised as a geometric mean with an interval; bad arguments get one error line."""
import json
import math

import pytest

from core_helpers import experiment_script
from domino_lab.errors import UserError


def _module():
    return experiment_script("speed_pair")


def test_speed_pair_reports_paired_ratios(tmp_path):
    mod = _module()
    assert mod.main(["--sets", "math", "--limit", "3", "--max-new-tokens", "8", "--rounds", "2", "--threads", "1",
                     "--a", "dom=default", "--b", "dfl=default-dflash", "--out", str(tmp_path / "r")]) == 0
    res = json.loads((tmp_path / "r" / "speed_pair.json").read_text())["results"]["math"]
    assert res["identical"] and res["prompts"] == 3 and res["wins"] + res["losses"] == 3
    logs = [math.log(p["wall_s_dfl"] / p["wall_s_dom"]) for p in res["per_prompt"]]
    assert res["ratio_geomean"] == pytest.approx(math.exp(sum(logs) / 3))
    assert res["ci95"][0] <= res["ratio_geomean"] <= res["ci95"][1]
    tokens = sum(p["tokens_dom"] for p in res["per_prompt"])
    assert tokens == sum(p["tokens_dfl"] for p in res["per_prompt"]) == 3 * 8 * 2
    assert res["tokens_per_s"]["dom"] == pytest.approx(tokens / sum(p["wall_s_dom"] for p in res["per_prompt"]))
    assert res["dtau"]["ci95"][0] <= res["dtau"]["mean"] <= res["dtau"]["ci95"][1]
    assert res["tau"]["dom"] - res["tau"]["dfl"] == pytest.approx(res["dtau"]["mean"])
    # τ is committed tokens per verify step: each round's prefill token is no step's
    want = [(p["tokens_dom"] - 2) / p["steps_dom"] for p in res["per_prompt"]]
    assert res["tau"]["dom"] == pytest.approx(sum(want) / 3)
    assert "| math | 3 |" in (tmp_path / "r" / "speed_pair.md").read_text()
    # --report recomputes the summary from the saved per-prompt counts alone, to the same numbers
    assert mod.main(["--report", str(tmp_path / "r")]) == 0
    again = json.loads((tmp_path / "r" / "speed_pair.json").read_text())
    assert json.dumps(again["results"]["math"], sort_keys=True) == json.dumps(res, sort_keys=True)
    assert "recomputed" in again["meta"]
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "speed_pair.json").write_text(json.dumps({"meta": again["meta"], "results": {"math": {
        "per_prompt": [{"id": "a"}], "identical": True}}}))
    with pytest.raises(UserError, match="no speed_pair.json with per-prompt counts"):
        mod.main(["--report", str(tmp_path / "old")])


def test_speed_pair_samples_at_a_temperature_with_options(tmp_path):
    """At T > 0 each round is a seeded sample; a label's options (@key=value) reach its drafter."""
    mod = _module()
    assert mod.main(["--sets", "math", "--limit", "2", "--max-new-tokens", "6", "--rounds", "2", "--threads", "1",
                     "--temperature", "1", "--a", "fused=default", "--b", "fast=default@head_impl=fast",
                     "--out", str(tmp_path / "r")]) == 0
    out = json.loads((tmp_path / "r" / "speed_pair.json").read_text())
    res = out["results"]["math"]
    assert out["meta"]["temperature"] == 1.0 and res["identical"] is None
    for p in res["per_prompt"]:
        assert p["tokens_fused"] == p["tokens_fast"] == 12
    ratios = [(p["tokens_fused"] / p["wall_s_fused"]) / (p["tokens_fast"] / p["wall_s_fast"])
              for p in res["per_prompt"]]
    assert res["ratio_geomean"] == pytest.approx(math.exp(sum(map(math.log, ratios)) / 2))
    assert "sampled at T = 1" in (tmp_path / "r" / "speed_pair.md").read_text()


def test_speed_pair_gumbel_sampler_checks_the_texts_match(tmp_path):
    """With the gumbel sampler on both sides a seed fixes the text: the two drafters' samples must be identical,
    and the report says so (with --sampler-b rejection they are not compared)."""
    mod = _module()
    assert mod.main(["--sets", "math", "--limit", "2", "--max-new-tokens", "12", "--rounds", "2", "--threads", "1",
                     "--temperature", "1", "--sampler", "gumbel", "--out", str(tmp_path / "g")]) == 0
    assert mod.main(["--sets", "math", "--limit", "1", "--max-new-tokens", "6", "--rounds", "1", "--threads", "1",
                     "--temperature", "1", "--sampler", "gumbel", "--sampler-b", "rejection",
                     "--out", str(tmp_path / "r")]) == 0
    res = json.loads((tmp_path / "g" / "speed_pair.json").read_text())["results"]["math"]
    assert res["identical"] is True
    assert "sampler gumbel" in (tmp_path / "g" / "speed_pair.md").read_text()
    both = json.loads((tmp_path / "r" / "speed_pair.json").read_text())
    assert both["results"]["math"]["identical"] is None and both["meta"]["samplers"] == {"domino": "gumbel",
                                                                                         "dflash": "rejection"}


@pytest.mark.parametrize("argv, msg", [(["--rounds", "0"], "--rounds"), (["--a", "default"], "LABEL=SPEC"),
                                       (["--a", "x=default", "--b", "x=default-dflash"], "different labels"),
                                       (["--temperature", "-1"], "--temperature"),
                                       (["--a", "x=default@speed=9"], "key=value")])
def test_speed_pair_bad_arguments(tmp_path, argv, msg):
    with pytest.raises(UserError, match=msg):
        _module().main(argv + ["--out", str(tmp_path / "bad")])
    assert not (tmp_path / "bad").exists()
