"""experiments/window_cache.py: a sliding-window target decoded with window layers and with full layers gives the
same tokens, one sequence and a batch, and the window layers hold less once the context is several windows long."""
import json

import pytest

from core_helpers import experiment_script
from domino_lab.errors import UserError


def test_window_cache_compares_memory_on_identical_outputs(tmp_path):
    mod = experiment_script("window_cache")
    assert mod.main(["--window", "8", "--layers", "2", "--hidden", "128", "--prompt-tokens", "20",
                     "--new-tokens", "600", "--rounds", "1", "--batch", "2", "--out", str(tmp_path / "r")]) == 0
    rows = json.loads((tmp_path / "r" / "window_cache.json").read_text())["rows"]
    assert [(r["decoding"], r["method"]) for r in rows] == [
        (decoding, method) for decoding in ("one sequence", "batch of 2") for method in ("plain", "domino (untrained)")]
    for r in rows:
        assert r["context"] == 620 and r["window_mib"] < r["full_mib"] / 2
    md = (tmp_path / "r" / "window_cache.md").read_text()
    assert "| one sequence | plain | 600 | 620 |" in md and "| batch of 2 | domino (untrained) | 600 | 620 |" in md
    with pytest.raises(UserError, match="multiple of 128"):
        mod.main(["--hidden", "100"])
