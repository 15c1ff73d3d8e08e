"""experiments/batch_drafts.py: fixed draft counts against the adaptive count and plain batched decoding, every
configuration lossless, with the step gain and step cost that explain each; bad arguments get one error line."""
import json

import pytest

from core_helpers import experiment_script
from domino_lab.errors import UserError


def _module():
    return experiment_script("batch_drafts")


def test_batch_drafts_compares_counts_losslessly(tmp_path):
    mod = _module()
    assert mod.main(["--sets", "math", "--limit", "3", "--batch-sizes", "2", "--counts", "0", "2",
                     "--max-new-tokens", "6", "--rounds", "1", "--threads", "1", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "batch_drafts.json").read_text())
    row = out["results"]["math"]["2"]
    assert row["threads"] == 1
    cfg = row["configs"]
    assert list(cfg) == ["ar", "n=0", "n=2", "adaptive"]
    for r in cfg.values():
        assert r["equal_to_ar"] == r["prompts"] == 3
        assert r["tokens_per_s"] > 0 and r["speedup_vs_ar"] > 0
    assert cfg["ar"]["tau"] == cfg["n=0"]["tau"] == 1.0           # a count of 0 only takes plain steps
    assert cfg["n=0"]["step_gain"] == 1.0 and cfg["ar"]["step_cost"] == 1.0
    assert 1.0 <= cfg["n=2"]["tau"] <= 3.0 and 1.0 <= cfg["n=2"]["step_gain"] <= 3.0
    assert cfg["n=0"]["draft_ms"] < cfg["n=2"]["draft_ms"]
    assert 0.5 < cfg["n=0"]["step_cost"] < 2.0                   # plain steps through the drafter's path
    md = (tmp_path / "batch_drafts.md").read_text()
    assert "| math | 2 | 1 | n=2 |" in md and (tmp_path / "batch_drafts.png").stat().st_size > 0


def test_batch_drafts_continuous_queue(tmp_path):
    """--continuous: the set decodes as one queue through `batch` slots, every configuration still lossless."""
    mod = _module()
    assert mod.main(["--sets", "humaneval", "--limit", "5", "--batch-sizes", "2", "--counts", "2",
                     "--max-new-tokens", "6", "--rounds", "1", "--threads", "1", "--continuous",
                     "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "batch_drafts.json").read_text())
    assert out["meta"]["continuous"] is True
    for r in out["results"]["humaneval"]["2"]["configs"].values():
        assert r["equal_to_ar"] == r["prompts"] == 5
    assert "one queue through `batch` slots" in (tmp_path / "batch_drafts.md").read_text()


@pytest.mark.parametrize("argv, match", [(["--counts", "1", "1"], "distinct"), (["--counts", "-1"], "distinct"),
                                         (["--limit", "0"], ">= 1"), (["--batch-sizes", "0"], ">= 1")])
def test_batch_drafts_bad_arguments(argv, match):
    with pytest.raises(UserError, match=match):
        _module().main(argv)


def test_batch_drafts_count_beyond_the_block(tmp_path):
    with pytest.raises(UserError, match="drafter's 8 drafts"):
        _module().main(["--sets", "math", "--limit", "1", "--counts", "9", "--threads", "1"])
