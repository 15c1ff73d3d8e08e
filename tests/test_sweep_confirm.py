"""The sweep's confirmation stage (domino_lab/sweep/confirm.py): head-only trials on a warm-started backbone, the
best trial and the baseline re-trained with more seeds, the paired verdict in summary.json, MLflow and the
terminal."""
import json
from pathlib import Path

import optuna
import pytest
import yaml
from mlflow.tracking import MlflowClient

from domino_lab.errors import run_cli
from domino_lab.sweep.__main__ import main
from domino_lab.sweep.confirm import VERDICTS, resolution, verdict
from core_helpers import tiny_sweep_yaml


def run(argv, capsys):
    with pytest.raises(SystemExit) as e:
        run_cli(main, argv)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_verdict_and_resolution():
    assert verdict([0.01, 0.2]) == "confirmed" and verdict([-0.3, -0.02]) == "worse"
    assert verdict([-0.01, 0.2]) == "not distinguishable from the baseline"
    r = resolution([1.0, 1.2, 1.4, 1.6], [1.30, 1.32, 1.34])
    assert r["noise_sd"] == pytest.approx(0.02) and r["spread_sd"] == pytest.approx(0.2582, abs=1e-4)
    assert r["resolved"] and r["spread_range"] == [1.0, 1.6]
    assert not resolution([1.0, 1.1], [1.0, 1.2, 1.4])["resolved"]
    assert resolution([1.0], [1.3])["noise_over_spread"] is None


@pytest.fixture(scope="module")
def confirm_yaml(tmp_path_factory):
    """Two head-only trials on a (tiny, untrained) dflash backbone, then one more seed of each in confirmation."""
    from domino_lab import Drafter
    from domino_lab.target import Target

    root = tmp_path_factory.mktemp("confirm")
    path, cfg = tiny_sweep_yaml(root, n_trials=2, tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    tdir = next(o.split("=", 1)[1] for o in cfg["overrides"] if o.startswith("target="))
    Drafter.untrained(Target.from_pretrained(tdir), "dflash", seed=1).save_pretrained(root / "backbone")
    cfg["overrides"] += [f"drafter.init_from={root / 'backbone'}", "optim.train=head", "data.val_fraction=0.3",
                         "data.features=offline", f"data.features_dir={root / 'features'}", "eval.tau_batch=2",
                         "eval.every_n_steps=12"]
    cfg.update(pruner={"type": "none"}, total_trials=2, confirm={"seeds": 1, "prompts": 3})
    path.write_text(yaml.safe_dump(cfg))
    return path, cfg


def test_confirmation_stage(confirm_yaml, capsys):
    path, cfg = confirm_yaml
    code, out, err = run(["--config", str(path)], capsys)
    assert code == 0, err[-3000:]
    # the terminal gets the answer, the table, the verdict and where to look; no JSON
    assert out.startswith("Best of 2 trials") and "Confirmation (2 seeds × 3 held-out prompts)" in out, out
    assert "summary.json" in out and not any(line.lstrip().startswith(("{", '"')) for line in out.splitlines())
    assert "trial 0 (1/2)" in err                                    # the progress inside trials
    sdir = Path(cfg["out_dir"]) / "tiny"
    summary = json.loads((sdir / "summary.json").read_text())
    conf = summary["confirmation"]
    assert conf["seeds"] == [0, 1] and conf["verdict"] in VERDICTS and len(conf["delta_ci"]) == 2
    assert conf["delta_ci"][0] <= conf["delta_mean"] <= conf["delta_ci"][1] and conf["n_pairs"] == 6
    assert conf["baseline"]["trial"] == 0 and conf["best"]["trial"] == 1
    assert len(conf["best"]["tau_per_seed"]) == 2 and conf["resolution"]["spread_range"] is not None
    assert len(summary["trials"]) == 2
    md = (sdir / "summary.md").read_text()
    assert f"**Confirmation: {conf['verdict']}.**" in md and "held-out prompts" in md
    # MLflow: the two re-trained seeds are runs nested under the study's parent, tagged
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{Path(cfg['out_dir']) / 'optuna.db'}")
    client = MlflowClient(cfg["tracking_uri"])
    parent = study.user_attrs["mlflow_parent_run_id"]
    exp = client.get_experiment_by_name("domino-lab-sweeps")
    kids = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")
    confirm_runs = [r for r in kids if r.data.tags.get("sweep.stage") == "confirmation"]
    assert sorted(r.data.tags["confirm.role"] for r in confirm_runs) == ["baseline", "best"]
    assert all(r.data.tags["confirm.seed"] == "1" and "confirm/tau" in r.data.metrics for r in confirm_runs)
    parent_run = client.get_run(parent)
    assert parent_run.data.tags["confirm.verdict"] == conf["verdict"] and parent_run.info.status == "FINISHED"
    # a re-run of the finished study trains nothing more and reports the same verdict, as JSON when asked
    code, out, err = run(["--config", str(path), "--json"], capsys)
    assert code == 0, err[-2000:]
    again = json.loads(out)
    assert again["confirmation"] == conf
    assert len(client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")) == len(kids)


def test_confirmation_input_errors(confirm_yaml, tmp_path, capsys):
    path, cfg = confirm_yaml
    for bad, msg in (({"confirm": {"seeds": -1}}, "confirm: seeds"), ({"confirm": {"seeds": 1, "prompts": 1}},
                                                                     "prompts >= 2")):
        (tmp_path / "s.yaml").write_text(yaml.safe_dump({**cfg, **bad, "out_dir": str(tmp_path / "o")}))
        code, _, err = run(["--config", str(tmp_path / "s.yaml")], capsys)
        assert code == 2 and err.strip().startswith("error: ") and msg in err and len(err.strip().splitlines()) == 1
    # more held-out prompts than the validation split holds: one line, and no study was created
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({**cfg, "confirm": {"seeds": 1, "prompts": 500},
                                                     "out_dir": str(tmp_path / "o2")}))
    code, _, err = run(["--config", str(tmp_path / "s.yaml")], capsys)
    assert code == 2 and "held-out prompts" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o2" / "optuna.db").exists()
    code, _, err = run(["--config", str(path), "--init-from", str(tmp_path / "missing"), "--runs-dir",
                        str(tmp_path / "r")], capsys)
    assert code == 2 and "init_from" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r").exists() or not list((tmp_path / "r").rglob("*.db"))
