"""Re-running a sweep continues its study only with a config whose trials compare with the study's own."""
import sqlite3
from pathlib import Path

import optuna
import pytest
import yaml

from domino_lab.errors import run_cli
from domino_lab.sweep import load_sweep, trial_config
from domino_lab.sweep.__main__ import main
from domino_lab.sweep.config import study_fingerprint
from domino_lab.sweep.runner import FINGERPRINT_ATTR
from core_helpers import tiny_sweep_yaml


def run(argv, capsys):
    with pytest.raises(SystemExit) as e:
        run_cli(main, argv)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def variant(path: Path, name: str, *, steps=None, space=None) -> Path:
    """The sweep YAML at `path` with another training budget and/or search space, written beside it."""
    cfg = yaml.safe_load(path.read_text())
    if steps is not None:
        cfg["overrides"] = [f"max_steps={steps}" if o.startswith("max_steps=") else o for o in cfg["overrides"]]
    cfg["space"].update(space or {})
    out = path.with_name(name)
    out.write_text(yaml.safe_dump(cfg))
    return out


def test_rerun_with_another_config_is_refused(tmp_path, capsys):
    path, cfg = tiny_sweep_yaml(tmp_path, n_trials=1, tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    db = Path(cfg["out_dir"]) / "optuna.db"

    def trials():
        return optuna.load_study(study_name="tiny", storage=f"sqlite:///{db}").trials

    code, _, err = run(["--config", str(path)], capsys)
    assert code == 0, err[-2000:]
    code, _, err = run(["--config", str(path), "--n-trials", "1"], capsys)     # unchanged: continues
    assert code == 0, err[-2000:]
    assert len(trials()) == 2
    # a longer training budget, or a narrower range: the new trials would be ranked with incomparable old ones
    for changed, key in ((variant(path, "steps.yaml", steps=13), "max_steps 12 → 13"),
                         (variant(path, "space.yaml", space={"drafter.rank": {"type": "int", "low": 4, "high": 8}}),
                          "space.drafter.rank")):
        code, _, err = run(["--config", str(changed), "--n-trials", "1"], capsys)
        lines = err.strip().splitlines()
        assert code == 2 and lines[-1].startswith("error: study 'tiny' was made with another config"), err[-2000:]
        assert key in lines[-1] and "--study-name" in lines[-1]
        assert len(trials()) == 2                                  # nothing was added to the study
    # a study made before studies kept a fingerprint is taken as it is, and keeps the config that continues it
    with sqlite3.connect(db) as con:
        con.execute("DELETE FROM study_user_attributes WHERE key = ?", (FINGERPRINT_ATTR,))
    steps = variant(path, "steps.yaml", steps=13)
    code, _, err = run(["--config", str(steps), "--prepare-only"], capsys)
    assert code == 0, err[-2000:]
    stored = optuna.load_study(study_name="tiny", storage=f"sqlite:///{db}").user_attrs[FINGERPRINT_ATTR]
    assert stored["max_steps"] == 13


def test_fingerprint_is_what_decides_a_trials_score(tmp_path):
    """Workers on other machines (another runs folder), with their own seed, trial count or storage, share the
    fingerprint; a training budget, data, eval or objective change does not."""
    path, _ = tiny_sweep_yaml(tmp_path, n_trials=2, data_path="runs/regenerated/tiny")

    def fp(overrides=(), runs_dir=tmp_path / "a"):
        sweep = load_sweep(path, list(overrides), runs_dir=runs_dir)
        return study_fingerprint(sweep, trial_config(sweep, {}, 0))

    base = fp()
    assert base["data.path"] == "runs/regenerated/tiny" and base["max_steps"] == 12
    assert fp(["seed=5", "n_trials=9", "total_trials=20", f"storage=sqlite:///{tmp_path / 'o.db'}",
               "confirm={seeds: 2}"], runs_dir=tmp_path / "b") == base
    over = yaml.safe_load(path.read_text())["overrides"]
    for extra, key in (("max_steps=13", "max_steps"), ("eval.tau_prompts=3", "eval.tau_prompts"),
                       ("data.path=runs/regenerated/other", "data.path")):
        changed = fp([f"overrides={yaml.safe_dump(over + [extra], default_flow_style=True).strip()}"])
        assert [k for k in base if base[k] != changed[k]] == [key]
    assert fp(["objectives=[tau, draft_cost]"])["objectives"] != base["objectives"]
