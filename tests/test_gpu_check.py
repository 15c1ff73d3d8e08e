"""experiments/gpu_check.py, the script a GPU session runs first: its decoding checks run end to end on the CPU
(losslessness against plain decoding and HF generate, then the interleaved bench), and a lossless run passes."""
from __future__ import annotations

from core_helpers import experiment_script


def test_decoding_checks_run_on_the_cpu(capsys):
    mod = experiment_script("gpu_check")
    rc = mod.main(["--device", "cpu", "--quick", "--prompts", "2", "--max-new-tokens", "12", "--threads", "1",
                   "--skip", "train"])
    out = capsys.readouterr()
    assert rc == 0, out.err[-2000:]
    table = out.out
    for method in ("hf", "domino", "dflash"):
        assert f"| lossless {method} " in table and f"| throughput {method} " in table
    assert "FAIL" not in table and "2/2 prompts identical to plain decoding" in table
    assert "τ " in table.split("| throughput domino ")[1].splitlines()[0]
