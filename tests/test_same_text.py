"""experiments/same_text.py: each step of a greedy Domino decode beside its backbone alone on the same text."""
import json

import pytest

from core_helpers import experiment_script, run_main


def _main():
    return experiment_script("same_text").main


def test_counts_agree_with_each_other(tmp_path):
    _main()(["--sets", "math", "code", "--limit", "2", "--max-new-tokens", "40", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "same_text.json").read_text())
    assert set(res["sets"]) == {"math", "code"}
    for name, r in res["sets"].items():
        s = r["summary"]
        assert s["prompts"] == 2 and s["steps"] == sum(p["steps"] for p in r["per_prompt"])
        for p in r["per_prompt"]:
            # every step commits >= 1 token; the decode's 40 tokens are the prefill's and the steps' own
            assert p["steps"] <= p["on_tokens"] == 40 - 1 and p["own_tokens"] == 40 - 1
            assert p["off_tokens"] >= p["steps"] and p["more"] + p["fewer"] <= p["steps"]
        assert s["tau_on"] == pytest.approx(sum(p["on_tokens"] for p in r["per_prompt"]) / s["steps"])
        assert s["ratio_same_text"] == pytest.approx(s["tau_on"] / s["tau_off_same_text"])
        # Domino over the baseline (default-dflash) splits into the head's same-text gain and its backbone's share
        assert all(p["baseline_tokens"] == 40 - 1 for p in r["per_prompt"])
        assert s["ratio_baseline"] == pytest.approx(s["ratio_own_text"] * s["backbone_own_over_baseline"])
        # a step gains from the head exactly where the blocks first differ at a slot the head fixed (and loses where
        # it broke one), except a last step that the budget cut short on both sides
        fixed = sum(c["fixed"] for c in r["slots"].values())
        broke = sum(c["broke"] for c in r["slots"].values())
        more, fewer = sum(p["more"] for p in r["per_prompt"]), sum(p["fewer"] for p in r["per_prompt"])
        assert more <= fixed <= more + 2 and fewer <= broke <= fewer + 2
        assert "0" not in r["slots"] or r["slots"]["0"]["fixed"] == r["slots"]["0"]["broke"] == 0
    md = (tmp_path / "same_text.md").read_text()
    # --report recomputes the same tables from the saved counts
    (tmp_path / "same_text.md").unlink()
    _main()(["--report", str(tmp_path)])
    assert (tmp_path / "same_text.md").read_text() == md
    assert "| math | 2 |" in md and "| code | 2 |" in md and "| 8 |" in md and "Against the baseline" in md


def test_without_a_baseline(tmp_path):
    _main()(["--sets", "math", "--limit", "1", "--max-new-tokens", "16", "--baseline", "none", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "same_text.json").read_text())
    assert res["baseline"] is None and "ratio_baseline" not in res["sets"]["math"]["summary"]
    assert "Against the baseline" not in (tmp_path / "same_text.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--drafter", "default-dflash"], "has no Domino head"),
    (["--limit", "0"], "--limit and --max-new-tokens must be >= 1"),
    (["--sets", "nope"], "is not a known evaluation set"),
    (["--report", "/nonexistent/x"], "--report /nonexistent/x: no same_text.json"),
])
def test_bad_input_is_one_error_line(argv, message, tmp_path, capsys):
    code, _, err = run_main(_main(), argv + ["--out", str(tmp_path / "o")], capsys)
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "o").exists()
