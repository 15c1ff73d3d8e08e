"""experiments/convergence.py: validation curves of training runs read back from MLflow, side by side."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))
import convergence  # noqa: E402


def _run(client, exp_id: str, folder: Path, taus: dict[int, float]) -> None:
    """A finished training run as domino_lab.train leaves it: MLflow metrics plus the folder's mlflow_run.json."""
    rid = client.create_run(exp_id).info.run_id
    for step, tau in taus.items():
        client.log_metric(rid, "val/tau", tau, step=step)
        for i in range(3):
            client.log_metric(rid, f"val/accept_pos_{i}", 0.5 + 0.1 * i, step=step)
    folder.mkdir(parents=True)
    (folder / "mlflow_run.json").write_text(json.dumps({"run_id": rid}))


def test_convergence_tables_the_curves_and_the_last_quarters_gain(tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("t")
    _run(client, exp, tmp_path / "short", {399: 2.0, 799: 3.0})
    _run(client, exp, tmp_path / "long", {399: 2.0, 799: 3.0, 1199: 3.5, 1599: 3.4})
    out = tmp_path / "res" / "conv"
    assert convergence.main(["--run", f"short={tmp_path / 'short'}", "--run", f"long={tmp_path / 'long'}",
                             "--tracking-uri", uri, "--out", str(out)]) == 0
    md = out.with_suffix(".md").read_text()
    assert "| long | 400, 800, 1200, 1600 | 2.00 / 3.00 / 3.50 / 3.40 | 3.50 | -0.10 |" in md     # plateaued
    assert "| short | 400, 800 | 2.00 / 3.00 | 3.00 | +1.00 | 0.50 / 0.60 / 0.70 |" in md         # still rising
    assert json.loads(out.with_suffix(".json").read_text())["curves"]["long"]["tau"] == [2.0, 3.0, 3.5, 3.4]
    assert out.with_suffix(".png").stat().st_size > 1000
    assert capsys.readouterr().out.strip() == md.strip()


@pytest.mark.parametrize("argv,msg", [(["--run", "nolabel"], "LABEL=DIR"),
                                      (["--run", "x=/nowhere"], "no mlflow_run.json")])
def test_convergence_bad_input_is_one_error_and_writes_nothing(tmp_path, argv, msg):
    from domino_lab.errors import UserError

    with pytest.raises(UserError, match=msg):
        convergence.main(argv + ["--out", str(tmp_path / "o")])
    assert list(tmp_path.iterdir()) == []
