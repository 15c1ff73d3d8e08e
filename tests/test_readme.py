"""The README's two newcomer commands are the ones CI runs, and they name real entry points."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def blocks():
    return re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text()
    test_block = next(b for b in blocks() if "pytest" in b)
    for line in test_block.strip().splitlines():
        assert line.strip() in ci, f"README line not in .ci/run: {line}"


def test_main_job_is_the_sweep():
    main_block = blocks()[0]
    assert "python -m domino_lab.sweep" in main_block
    assert "pip install torch==2.13.0" in main_block
