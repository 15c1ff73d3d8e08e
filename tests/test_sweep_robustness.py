"""How the sweep and the experiment runner end when something goes wrong: a SIGTERM, a trial that fails, a killed
worker, a tracking store that cannot be used, input that is checked only in part; and what they reuse on a re-run
(a finished confirmation, a trained run folder)."""
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml
from mlflow.tracking import MlflowClient

from domino_lab.errors import UserError, run_cli
from domino_lab.sweep.__main__ import main
from core_helpers import tiny_sweep_yaml

ENV = dict(os.environ, OMP_NUM_THREADS="1")


def run(argv, capsys, cli=main):
    with pytest.raises(SystemExit) as e:
        run_cli(cli, argv)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A one-trial tiny sweep (12-step trials on a tiny target and its regenerated data)."""
    root = tmp_path_factory.mktemp("robust")
    return tiny_sweep_yaml(root, n_trials=1, tracking_uri=f"sqlite:///{root / 'mlflow.db'}")


def trial_overrides(cfg, *more):
    """The sweep YAML's trial overrides (target, data, tiny sizes) with `more` after them, as one override."""
    return "overrides=" + json.dumps(cfg["overrides"] + list(more))


def wait_for(folder: Path, pattern: str, proc, timeout=300):
    """The first file in `folder` matching `pattern`, once there is one (the process must still be running)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = list(folder.glob(pattern))
        if found:
            return found[0]
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    raise AssertionError(f"no {pattern} in {folder}")


def last_line(err: str) -> str:
    return [line for line in err.splitlines() if line.strip()][-1]


def sigterm_in_training(p, folder, pattern: str) -> str:
    """SIGTERM to process `p` once `pattern` exists under `folder` and its training has begun; its stderr."""
    try:
        wait_for(folder, pattern, p)
        time.sleep(1.5)
        p.send_signal(signal.SIGTERM)
        return p.communicate(timeout=120)[1]
    finally:
        p.kill()


def test_sigterm_mid_trial_is_an_error_and_the_trial_is_queued_again(tiny, tmp_path):
    """Lightning's SIGTERMException is a SystemExit without a code: it went through Optuna and run_cli as exit 0,
    with no word and the trial left RUNNING. Now: one error line, exit 143, the trial failed and queued again,
    its MLflow run and the study's parent run ended."""
    path, cfg = tiny
    out, runs = tmp_path / "sw", tmp_path / "runs"
    p = subprocess.Popen([sys.executable, "-m", "domino_lab.sweep", "--config", str(path), f"out_dir={out}",
                          f"runs_dir={runs}", "--threads", "1", "pruner={type: none}",
                          trial_overrides(cfg, "max_steps=3000", "eval.every_n_steps=1000",
                                          "checkpoint_every_n_steps=1000")],
                         env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err = sigterm_in_training(p, out, "tiny/trial_0000/mlflow_run.json")     # written just before fit starts
    assert p.returncode == 143, err[-3000:]
    assert last_line(err) == "error: sweep stopped by SIGTERM; run the same command again to continue the study"
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{out / 'optuna.db'}")
    states = [t.state.name for t in study.trials]
    assert states == ["FAIL", "WAITING"] and study.trials[1].params == study.trials[0].params, states
    client = MlflowClient(cfg["tracking_uri"])
    run_ = client.get_run(study.trials[0].user_attrs["mlflow_run_id"])
    assert run_.info.status == "KILLED" and run_.data.tags["optuna.state"] == "FAIL"
    assert client.get_run(study.user_attrs["mlflow_parent_run_id"]).info.status == "KILLED"


def test_sigterm_during_experiment_training_is_an_error(tiny, tmp_path):
    path, cfg = tiny
    spec = tmp_path / "tiny.yaml"
    spec.write_text(yaml.safe_dump({"title": "t", "runs": {"domino": {"recipe": "domino"}}, "sets": ["math"],
                                    "variants": [{"name": "ar"}, {"name": "domino", "run": "domino"}],
                                    "limit": 1, "max_new_tokens": 8}))
    runs = tmp_path / "runs"
    p = subprocess.Popen([sys.executable, "-m", "domino_lab.experiments", "run", str(spec), *cfg["overrides"],
                          "max_steps=3000", "eval.every_n_steps=1000", "checkpoint_every_n_steps=1000", "threads=1",
                          "--runs-dir", str(runs), "--out-dir", str(tmp_path / "out"), "--no-progress"],
                         env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err = sigterm_in_training(p, runs, "domino-s0-*/mlflow_run.json")
    assert p.returncode == 143, err[-3000:]
    assert last_line(err).startswith("error: training stopped by SIGTERM; run the same command again to continue")
    assert not (tmp_path / "out").exists()


def test_a_trial_that_fails_ends_its_mlflow_run_and_the_parent(tiny, tmp_path, capsys):
    """A trial whose train() raises is FAIL in Optuna; its MLflow run was left RUNNING for ever, and so was the
    study's parent run when the error ended the sweep."""
    path, cfg = tiny
    spec = yaml.safe_load(path.read_text())
    spec["space"]["data.path"] = {"type": "categorical", "choices": [str(tmp_path / "no-data")]}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    code, _, err = run(["--config", str(tmp_path / "s.yaml"), "--runs-dir", str(tmp_path / "runs")], capsys)
    assert code == 2 and "no-data does not exist" in last_line(err), err[-2000:]
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'runs' / 'optuna.db'}")
    assert [t.state.name for t in study.trials] == ["FAIL"]
    client = MlflowClient(cfg["tracking_uri"])
    run_ = client.get_run(study.trials[0].user_attrs["mlflow_run_id"])
    assert run_.info.status == "FAILED" and run_.data.tags["optuna.state"] == "FAIL"
    assert client.get_run(study.user_attrs["mlflow_parent_run_id"]).info.status == "FAILED"


def test_a_killed_workers_trial_run_is_ended_when_the_next_worker_prepares(tiny, tmp_path):
    """SIGKILL leaves the trial RUNNING with a heartbeat that goes stale; the next worker's preparation fails it
    (queued again) and ends its MLflow run, even when no trial is left for that worker to run."""
    from domino_lab.sweep import load_sweep, prepare

    path, _ = tiny
    sweep = load_sweep(path, ["heartbeat_interval=1", "grace_period=1"], runs_dir=tmp_path / "runs")
    runner = prepare(sweep)
    trial = runner.study.ask()                      # what a worker does, then it is killed
    runner.study._storage.record_heartbeat(trial._trial_id)
    run_id = runner.client.create_run(runner._experiment_id(), run_name="trial-0").info.run_id
    trial.set_user_attr("mlflow_run_id", run_id)
    time.sleep(2.5)                                 # the heartbeat goes stale
    again = prepare(sweep, target=runner.target)
    assert [t.state.name for t in again.study.trials] == ["FAIL", "WAITING"]
    run_ = runner.client.get_run(run_id)
    assert run_.info.status == "KILLED" and run_.data.tags["optuna.state"] == "FAIL"


def test_an_unusable_tracking_store_fails_before_the_study(tiny, tmp_path, capsys, monkeypatch):
    path, _ = tiny
    bad = tmp_path / "bad" / "mlflow.db"
    bad.parent.mkdir()
    bad.write_bytes(os.urandom(5000))
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    for uri in (f"sqlite:///{bad}", "http://u:hunter2@127.0.0.1:1"):
        runs = tmp_path / "runs"
        code, _, err = run(["--config", str(path), "--runs-dir", str(runs), "--tracking-uri", uri,
                            "--prepare-only"], capsys)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: cannot use the MLflow tracking store"), err
        assert "hunter2" not in err
        assert not runs.exists(), list(runs.rglob("*"))       # no study, no sweep folder


def test_resume_into_a_deleted_mlflow_run_is_one_error(tmp_path):
    from domino_lab.training.tracking import RUN_FILE, make_logger

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    client.delete_run(run_id)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / RUN_FILE).write_text(json.dumps({"run_id": run_id}))
    with pytest.raises(UserError, match=f"MLflow run {run_id} .* was deleted .*mlflow runs restore"):
        make_logger(uri, "e", "r", tmp_path / "run", resume=True)


def test_int_step_null_is_no_step():
    from domino_lab.sweep.space import suggest, validate_space

    space = {"drafter.rank": {"type": "int", "low": 4, "high": 16, "step": None}}
    validate_space(space)
    assert 4 <= suggest(optuna.create_study().ask(), space)["drafter.rank"] <= 16


@pytest.mark.parametrize("change, msg", [
    ({"sampler": {"type": "tpe", "seed": 0, "n_startup_trials": "abc"}},
     "sampler tpe: n_startup_trials must be a whole number, got 'abc'"),
    ({"pruner": {"type": "median", "n_warmup_steps": "3"}}, "pruner median: n_warmup_steps must be a whole number"),
    ({"sampler": {"type": "tpe", "seed": 1.5}}, "sampler tpe: seed must be a whole number or null"),
    ({"space": {"loss.curriculum.type": {"type": "categorical", "choices": ["linear", "bogus", "cosine"]}}},
     "unknown lambda schedule 'bogus'"),
    ({"storage": "sqlite:///"}, "in-memory SQLite database"),
    ({"storage": "sqlite://"}, "in-memory SQLite database"),
])
def test_bad_sweep_arguments_fail_before_any_study(tiny, tmp_path, capsys, change, msg):
    """Each was accepted, the study made, and the sweep died (or kept nothing) once a trial used it."""
    spec = yaml.safe_load(tiny[0].read_text())
    spec.update({k: v for k, v in change.items() if k != "space"})
    spec["space"].update(change.get("space", {}))
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    code, _, err = run(["--config", str(tmp_path / "s.yaml"), "--runs-dir", str(tmp_path / "runs"),
                        "--prepare-only"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and msg in lines[0], err
    assert not (tmp_path / "runs").exists()


def test_name_and_url_flags_are_strings(tiny, tmp_path):
    """--study-name "ablation #2" was cut at the YAML comment, 0042 became the number 42."""
    from domino_lab.sweep import trial_config
    from domino_lab.sweep.__main__ import parse_args

    path, _ = tiny
    uri = f"sqlite:///{tmp_path / 'a #b' / 'mlflow.db'}"
    for name in ("ablation #2", "0042"):
        sweep, _ = parse_args(["--config", str(path), "--study-name", name, "--tracking-uri", uri,
                               "--storage", f"sqlite:///{tmp_path / 'o #1.db'}", "--target", "default"])
        assert sweep.study_name == name and sweep.tracking_uri == uri and sweep.storage.endswith("o #1.db")
        assert trial_config(sweep, {}, 0).tracking_uri == uri


def test_report_of_a_damaged_results_file_is_one_error(tmp_path, capsys):
    from domino_lab.experiments.__main__ import main as experiments

    for text in ("{}", "[]", '{"meta": {"runs": {"x": "y"}}}', '{"meta": {"runs": []}, "results": {}}'):
        (tmp_path / "head_ablation.json").write_text(text)
        code, _, err = run(["report", "head_ablation", "--out-dir", str(tmp_path)], capsys, cli=experiments)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and str(tmp_path / "head_ablation.json") in lines[0], (text, err)
        assert not (tmp_path / "head_ablation.md").exists()


class _Trainer:
    sanity_checking = False
    max_steps = 12

    def __init__(self, step):
        self.global_step, self.callback_metrics = step, {"val/tau": 1.25}


class _AlwaysPrune:
    def __init__(self):
        self.reported = []

    def report(self, value, step):
        self.reported.append(step)

    def should_prune(self):
        return True


def test_the_last_validation_never_prunes():
    """A trial that ran all max_steps is complete: its final validation used to prune it."""
    from domino_lab.sweep.runner import StepPruningCallback

    cb = StepPruningCallback(_AlwaysPrune(), monitor="val/tau")
    with pytest.raises(optuna.TrialPruned):
        cb.on_validation_end(_Trainer(6), None)
    cb.on_validation_end(_Trainer(12), None)
    assert cb._trial.reported == [6, 12]


def test_summary_json_has_no_bare_nan():
    from domino_lab.sweep.report import _json_safe

    safe = _json_safe({"a": [1.0, float("nan"), {"b": float("inf")}], "c": (2, "x")})
    assert json.loads(json.dumps(safe, allow_nan=False)) == {"a": [1.0, None, {"b": None}], "c": [2, "x"]}


def test_smoothing_skips_nan_points():
    """One NaN point made every later point of the running mean NaN (a blank curve from there on)."""
    from domino_lab.experiments.curves import smooth

    ys = smooth([1.0, float("nan"), 3.0, 5.0], w=2)
    assert ys[0] == 1.0 and ys[1] == 1.0 and ys[2] == 2.0 and ys[3] == 4.0
    assert math.isnan(smooth([float("nan"), 2.0])[0])


def test_experiment_run_folder_is_reused_only_for_its_own_config(tiny, tmp_path):
    """A finished run folder was reused whatever the spec (or --quick) now asked of it, and its config reported as
    the new one. Its trained config is recorded: another is one error before anything trains; a folder from before
    the record is reused as it was."""
    from domino_lab.experiments.spec import parse_spec
    from domino_lab.experiments.training import CONFIG_RECORD, resolve_runs, train_runs

    tiny_run = tiny[1]["overrides"] + ["threads=1"]

    def resolved(*more):
        spec = parse_spec({"title": "t", "runs": {"domino": {"recipe": "domino", "overrides": tiny_run + list(more)}},
                           "variants": [{"name": "ar"}, {"name": "domino", "run": "domino"}]}, "t", "t.yaml")
        return resolve_runs(spec, tmp_path / "runs", quick=False, tracking_uri=f"sqlite:///{tmp_path / 'm.db'}",
                            runs_root=tmp_path)

    first = train_runs(resolved(), tmp_path / "runs", quick=False, runs_root=tmp_path)
    folder = Path(first[("domino", 0)].out_dir)
    assert json.loads((folder / CONFIG_RECORD).read_text())["config"]["max_steps"] == 12
    again = train_runs(resolved(), tmp_path / "runs", quick=False, runs_root=tmp_path)       # the same: reused
    assert again[("domino", 0)].path == first[("domino", 0)].path
    mtime = (folder / "result.json").stat().st_mtime
    with pytest.raises(UserError, match=r"holds a drafter trained with another config .*loss.gamma 4.0 → 3.0.*"
                                        r"delete that folder"):
        train_runs(resolved("loss.gamma=3.0"), tmp_path / "runs", quick=False, runs_root=tmp_path)
    assert (folder / "result.json").stat().st_mtime == mtime
    (folder / CONFIG_RECORD).unlink()                     # a folder trained before configs were recorded
    old = train_runs(resolved("loss.gamma=3.0"), tmp_path / "runs", quick=False, runs_root=tmp_path)
    assert old[("domino", 0)].path == first[("domino", 0)].path


def test_experiment_training_checks_the_tracking_store_first(tiny, tmp_path):
    """A damaged store was found by the first training's logger: a traceback, and an empty run folder left."""
    from domino_lab.experiments.spec import parse_spec
    from domino_lab.experiments.training import resolve_runs, train_runs

    bad = tmp_path / "mlflow.db"
    bad.write_bytes(os.urandom(5000))
    spec = parse_spec({"title": "t", "runs": {"domino": {"recipe": "domino", "overrides": tiny[1]["overrides"]}},
                       "variants": [{"name": "ar"}, {"name": "domino", "run": "domino"}]}, "t", "t.yaml")
    runs = tmp_path / "runs"
    res = resolve_runs(spec, runs, quick=False, tracking_uri=f"sqlite:///{bad}", runs_root=tmp_path)
    with pytest.raises(UserError, match="cannot use the MLflow tracking store .*file is not a database"):
        train_runs(res, runs, quick=False, runs_root=tmp_path)
    assert not runs.exists()


def test_more_confirmation_seeds_or_prompts_are_run_not_ignored(tmp_path, capsys):
    """A finished study re-run with more confirm.seeds returned the stored confirmation; now it trains only the
    missing seeds, and another confirm.prompts scores the trained models again (nothing trained)."""
    path, cfg = tiny_sweep_yaml(tmp_path, n_trials=2, tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    cfg["overrides"] += ["data.val_fraction=0.3", "eval.every_n_steps=12"]
    cfg.update(pruner={"type": "none"}, total_trials=2, confirm={"seeds": 1, "prompts": 2})
    path.write_text(yaml.safe_dump(cfg))

    def confirm(*more):
        code, out, err = run(["--config", str(path), "--runs-dir", str(tmp_path / "runs"), "--json", *more], capsys)
        assert code == 0, err[-3000:]
        return json.loads(out)["confirmation"]

    def runs():
        client = MlflowClient(cfg["tracking_uri"])
        exp = client.get_experiment_by_name("domino-lab-sweeps")
        return client.search_runs([exp.experiment_id], "tags.`sweep.stage` = 'confirmation'")

    first = confirm()
    assert first["seeds"] == [0, 1] and len(runs()) == 2
    more = confirm("confirm={seeds: 2, prompts: 2}")
    assert more["seeds"] == [0, 1, 2] and len(runs()) == 4           # seed 2 of the best and the baseline only
    assert more["best"]["tau_per_seed"][:2] == first["best"]["tau_per_seed"]
    fewer = confirm("confirm={seeds: 2, prompts: 3}")
    assert fewer["prompts"] == 3 and fewer["n_pairs"] == 9 and len(runs()) == 4


def test_workers_sharing_a_study_count_running_trials_and_only_the_last_one_confirms(tmp_path):
    """With total_trials, a worker counted only finished trials: a worker whose trial ended while another worker's
    still ran started one more (overshooting the total), and took the study as done and confirmed its winner while
    the other trial, which might still win, was running."""
    from domino_lab.sweep.runner import stop_at_total, study_done

    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'o.db'}", study_name="s")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    other = study.ask()                          # another worker's trial, still running
    assert not study_done(study, 2) and not study_done(study, None)
    # this worker's next trial completes the total with the running one; the budget callback stops it there
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=5, callbacks=[stop_at_total(3)])
    assert [t.state.name for t in study.trials].count("COMPLETE") == 2
    assert not study_done(study, 3)
    study.tell(other, 0.5)
    assert study_done(study, 3) and study_done(study, None)
    study.enqueue_trial({"x": 0.1})              # a queued trial: the study without a total is not done
    assert study_done(study, 3) and not study_done(study, None)


def test_a_killed_workers_stale_trial_stops_counting_against_the_total(tmp_path):
    """A trial whose worker was killed stays RUNNING until its heartbeat is stale; the worker that goes on fails it
    then (Optuna's retry queues it again) and runs to the total instead of stopping one short."""
    from domino_lab.sweep.runner import stop_at_total

    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'o.db'}", heartbeat_interval=1, grace_period=1)
    study = optuna.create_study(storage=storage, study_name="s")
    dead = study.ask()
    storage.record_heartbeat(dead._trial_id)

    def objective(t):
        time.sleep(2 if t.number == 1 else 0)    # the dead trial's heartbeat goes stale meanwhile
        return t.suggest_float("x", 0, 1)
    study.optimize(objective, n_trials=5, callbacks=[stop_at_total(2)])
    states = [t.state.name for t in study.trials]
    assert states[0] == "FAIL" and states.count("COMPLETE") == 2
