"""`python -m domino_lab.sweep` on a tiny target: trials, pruning, resume, two workers, MLflow nesting."""
import json
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml
from mlflow.tracking import MlflowClient

from domino_lab.errors import UserError
from domino_lab.sweep.__main__ import main
from domino_lab.sweep.storage import sweep_storage
from core_helpers import run_main, tiny_sweep_yaml, tiny_target


@pytest.fixture(scope="module")
def sweep_yaml(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    return tiny_sweep_yaml(root, n_trials=3, tracking_uri=f"sqlite:///{root / 'mlflow.db'}")


def run(argv, capsys):
    return run_main(main, argv, capsys)


def test_sweep_runs_resumes_and_tracks(sweep_yaml, capsys):
    path, cfg = sweep_yaml
    code, out, err = run(["--config", str(path)], capsys)
    assert code == 0, err[-2000:]
    assert out.startswith("Best of 3 trials"), out[:500]
    sdir = Path(cfg["out_dir"]) / "tiny"
    summary = json.loads((sdir / "summary.json").read_text())
    assert len(summary["trials"]) == 3 and summary["counts"]["COMPLETE"] >= 1
    assert (sdir / "plots" / "optimization_history.png").exists()
    # re-running continues the same study
    code, out, err = run(["--config", str(path), "--n-trials", "1"], capsys)
    assert code == 0, err[-2000:]
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{Path(cfg['out_dir']) / 'optuna.db'}")
    assert len(study.trials) == 4
    # MLflow: one parent run for the study, each trial nested under it with its state
    client = MlflowClient(cfg["tracking_uri"])
    parent = study.user_attrs["mlflow_parent_run_id"]
    exp = client.get_experiment_by_name("domino-lab-sweeps")
    kids = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")
    assert len(kids) == 4
    states = {r.data.tags.get("optuna.state") for r in kids}
    assert "COMPLETE" in states
    done = [r for r in kids if r.data.tags.get("optuna.state") == "COMPLETE"]
    assert all("val/tau" in r.data.metrics and "val/accept_pos_0" in r.data.metrics for r in done)
    # each complete trial's step costs, measured after it, and the speedup estimate they give with its τ
    assert all(r.data.metrics["cost/draft_ms"] > 0 and r.data.metrics["cost/step_ms"] > 0 for r in done)
    for t in (t for t in summary["trials"] if t["state"] == "COMPLETE"):
        assert t["speedup_est"] == pytest.approx(t["values"][0] * t["step_ms"] / (t["draft_ms"] + t["verify_ms"]))
    arts = {a.path for a in client.list_artifacts(parent)}
    assert "summary.md" in arts and "plots" in arts
    assert client.get_run(parent).info.status == "FINISHED"       # nothing left to run in the study


def test_sweep_costs_script_on_a_finished_sweep(sweep_yaml, tmp_path, capsys):
    """experiments/sweep_costs.py times a finished sweep's drafters both ways and writes its table."""
    import importlib.util

    from domino_lab.errors import UserError

    path, cfg = sweep_yaml
    sdir = Path(cfg["out_dir"]) / "tiny"
    if not (sdir / "summary.json").exists():          # run alone: the study the module's first test makes
        assert run(["--config", str(path)], capsys)[0] == 0
    spec = importlib.util.spec_from_file_location("sweep_costs", Path(__file__).resolve().parents[1] / "experiments"
                                                  / "sweep_costs.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    done = [t["trial"] for t in json.loads((sdir / "summary.json").read_text())["trials"] if t["state"] == "COMPLETE"]
    opts = dict(o.split("=", 1) for o in cfg["overrides"])
    out = tmp_path / "sc"
    assert script.main(["--sweep-dir", str(sdir), "--trials", str(done[0]), "--repeats", "2", "--quick", "--threads",
                        "1", "--target", opts["target"], "--data", opts["data.path"], "--out", str(out)]) == 0
    md = (out / "sweep_costs.md").read_text()
    assert f"| {done[0]} |" in md and "| decode |" in md and "| step_costs |" in md
    res = json.loads((out / "sweep_costs.json").read_text())["results"][str(done[0])]
    assert len(res["decode"]) == 2 and all(c["speedup_est"] > 0 for c in res["step_costs"])
    with pytest.raises(UserError, match="have no trained drafter"):
        script.main(["--sweep-dir", str(sdir), "--trials", "99"])


def test_two_workers_share_one_study(sweep_yaml, tmp_path):
    path, cfg = sweep_yaml
    out = tmp_path / "sw2"
    args = [sys.executable, "-m", "domino_lab.sweep", "--config", str(path), "study_name=pair",
            f"out_dir={out}", "n_trials=2", "--threads", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-2000:]
    study = optuna.load_study(study_name="pair", storage=f"sqlite:///{out / 'optuna.db'}")
    numbers = [t.number for t in study.trials]
    assert len(numbers) == 4 and len(set(numbers)) == 4            # n_trials counts per worker
    dirs = {t.user_attrs.get("best_dir") for t in study.trials if t.state.name == "COMPLETE"}
    assert None not in dirs and len(dirs) == sum(t.state.name == "COMPLETE" for t in study.trials)


def _claim_all(url, queue):
    study = optuna.load_study(study_name="claims", storage=sweep_storage(url))
    claimed = []
    while (trial_id := study._pop_waiting_trial_id()) is not None:     # what optimize() does to start a trial
        claimed.append(trial_id)
    queue.put(claimed)


def test_enqueued_trials_are_claimed_once(tmp_path):
    """SQLite ignores SELECT ... FOR UPDATE: without the claim lock, workers popping enqueued trials together
    train some of them twice (4 processes over 60 trials popped 70-74)."""
    import multiprocessing as mp

    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    study = optuna.create_study(study_name="claims", storage=url)
    for i in range(60):
        study.enqueue_trial({"x": i})
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_claim_all, args=(url, queue)) for _ in range(4)]
    for p in procs:
        p.start()
    claimed = sum((queue.get(timeout=120) for _ in procs), [])
    for p in procs:
        p.join(timeout=60)
    assert sorted(claimed) == sorted(t._trial_id for t in study.get_trials())


def test_space_overrides_address_parameters_by_their_dotted_names():
    """`space.drafter.rank.low=8` made a section 'drafter' in the space and failed with "space.drafter: needs
    'type'"; it now sets 'low' of 'drafter.rank', and a new parameter given as a nested override is one error
    saying how a parameter is named."""
    from domino_lab.sweep.config import load_sweep

    space = load_sweep(overrides=["space.drafter.rank.low=8", "space.optim.lr={type: fixed, value: 0.001}"]).space
    assert space["drafter.rank"]["low"] == 8 and space["optim.lr"] == {"type": "fixed", "value": 0.001}
    assert "drafter" not in space and "optim" not in space
    with pytest.raises(UserError, match=r"space\.drafter: needs 'type'.*named by its whole key, e\.g\. "
                                        r"'drafter\.num_layers'"):
        load_sweep(overrides=["space.drafter.num_layers={type: int, low: 1, high: 2}"])


def test_bad_sweep_config(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"space": {"drafter.rank": {"type": "int", "low": 8, "high": 4}}}))
    code, _, err = run(["--config", str(bad)], capsys)
    assert code == 2 and err.strip().startswith("error: space.drafter.rank") and len(err.strip().splitlines()) == 1
    for space, msg in (({"drafter.bogus": {"type": "int", "low": 1, "high": 4}}, "drafter.bogus"),
                       ({"loss.curriculum.type": {"type": "categorical", "choices": []}}, "non-empty")):
        bad.write_text(yaml.safe_dump({"space": space}))
        code, _, err = run(["--config", str(bad)], capsys)
        assert code == 2 and msg in err and len(err.strip().splitlines()) == 1, err
    code, _, err = run(["--config", str(tmp_path / "missing.yaml")], capsys)
    assert code == 2 and "cannot read config" in err
    for objectives in (["draft_ms"], ["tau", "speed"], ["tau", "draft_ms", "draft_cost"]):
        bad.write_text(yaml.safe_dump({"objectives": objectives,
                                       "space": {"drafter.rank": {"type": "int", "low": 4, "high": 8}}}))
        code, _, err = run(["--config", str(bad)], capsys)
        assert code == 2 and "objectives must be [tau]" in err and len(err.strip().splitlines()) == 1, err


def test_step_costs_run_in_turn_at_decoding_threads():
    """The trial's cost measurement: positive medians of each part, at decoding's thread count (1 for a small
    target on a CPU), the caller's count restored afterwards."""
    import torch

    from domino_lab.experiments.timing import step_costs
    from domino_lab.models import Drafter

    target = tiny_target()
    d = Drafter.untrained(target, "domino", block_size=4, num_layers=1).eval()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        costs = step_costs(target, d, ctx=16, reps=2, rounds=1)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert costs["threads"] == 1
    assert all(costs[k] > 0 for k in ("draft_ms", "verify_ms", "step_ms"))


def test_pareto_sweep_of_tau_against_draft_cost(tmp_path, capsys):
    """objectives [tau, draft_cost]: a two-direction study whose second value is each trial's draft step ÷ plain
    step, a Pareto-front answer and plot."""
    path, cfg = tiny_sweep_yaml(tmp_path, n_trials=2, objectives=["tau", "draft_cost"], confirm={"seeds": 0},
                                tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    code, out, err = run(["--config", str(path)], capsys)
    assert code == 0, err[-2000:]
    assert out.startswith("Pareto front of τ vs draft latency") and "× a plain step" in out, out[:500]
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{Path(cfg['out_dir']) / 'optuna.db'}")
    assert [d.name for d in study.directions] == ["MAXIMIZE", "MINIMIZE"]
    for t in study.get_trials(states=[optuna.trial.TrialState.COMPLETE]):
        assert t.values[1] == pytest.approx(t.user_attrs["draft_ms"] / t.user_attrs["step_ms"])
    assert (Path(cfg["out_dir"]) / "tiny" / "plots" / "pareto_front.png").exists()


def test_bad_sweep_input_fails_before_anything_is_created(tmp_path, capsys):
    """A malformed range, a tracking URI MLflow cannot open, a bad sampler or pruner argument, an unknown storage
    dialect, values a trial's config would reject: one error line, and no optuna.db or mlflow.db."""
    runs = tmp_path / "runs"
    good = {"base_config": None, "space": {"drafter.rank": {"type": "int", "low": 4, "high": 16}}}
    cases = [
        ({"space": {"drafter.rank": {"type": "int", "low": "four", "high": 16}}}, [], "space.drafter.rank"),
        ({"space": {"drafter.rank": {"type": "int", "low": 4.5, "high": 16}}}, [], "whole number"),
        ({"space": {"optim.lr": {"type": "float", "low": 1e-4, "high": "lots"}}}, [], "space.optim.lr"),
        ({"space": {"optim.lr": {"type": "float", "low": 0.0, "high": 1e-3}}}, [], "optim.lr"),   # low end: lr 0
        ({"space": {"loss.curriculum.start": {"type": "float", "low": 0.5, "high": 2.0}}}, [], "curriculum"),
        ({}, ["--tracking-uri", "bogus://x"], "tracking URI 'bogus://x'"),
        ({"sampler": {"type": "tpe", "n_startup": 3}}, [], "sampler tpe"),
        ({"pruner": {"type": "median", "warmup": 2}}, [], "pruner median"),
        ({}, ["--storage", "bogus://u:pw@host/db"], "--storage"),
        ({}, ["--seed", str(2 ** 40)], "seed"),
        # a SQLite file whose folder cannot be made (a file stands where the folder would be)
        ({}, ["--storage", f"sqlite:///{tmp_path / 'blocker' / 'optuna.db'}"],
         "which is a file, not a folder; choose another --storage"),
    ]
    (tmp_path / "blocker").write_text("")
    for spec, flags, msg in cases:
        (tmp_path / "s.yaml").write_text(yaml.safe_dump(good | spec))
        code, _, err = run(["--config", str(tmp_path / "s.yaml"), "--runs-dir", str(runs), *flags], capsys)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and msg in lines[0], (spec, err)
        assert "pw" not in err
        assert not runs.exists() or not [p.name for p in runs.rglob("*.db")], (spec, list(runs.rglob("*")))
        if "blocker" in str(flags):         # found before the sweep's own folder was made
            assert not (runs / "domino-default").exists() and not any(runs.rglob("*")), list(runs.rglob("*"))


def test_storage_password_is_masked(tmp_path, capsys):
    """Every line the sweep prints about its storage shows postgresql://user:***@host, never the password."""
    spec = {"base_config": None, "space": {"drafter.rank": {"type": "int", "low": 4, "high": 16}}}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    url = "postgresql://domino:hunter2@127.0.0.1:1/optuna"      # nothing listens on port 1
    code, out, err = run(["--config", str(tmp_path / "s.yaml"), "--runs-dir", str(tmp_path / "runs"),
                          "--storage", url], capsys)
    assert code == 2 and "hunter2" not in out + err, err
    assert "postgresql://domino:***@127.0.0.1:1/optuna" in err


def test_sigkill_mid_trial_then_resume(sweep_yaml, tmp_path):
    """Kill -9 a worker inside a trial; the re-run keeps finished trials, marks the killed one FAIL (stale
    heartbeat) and continues the study to its requested total."""
    import signal
    import time

    path, cfg = sweep_yaml
    out = tmp_path / "killed"
    storage = f"sqlite:///{out / 'optuna.db'}"
    args = [sys.executable, "-m", "domino_lab.sweep", "--config", str(path), "study_name=kill", f"out_dir={out}",
            "n_trials=10", "total_trials=3", "heartbeat_interval=1", "grace_period=3", "overrides=" + json.dumps(
                cfg["overrides"][:2] + ["max_steps=40", "eval.every_n_steps=20", "data.batch_size=4",
                                        "eval.tau_prompts=2", "eval.tau_max_new_tokens=16", "loss.num_anchors=8",
                                        "checkpoint_every_n_steps=20", "drafter.rank=8", "drafter.gru_hidden=16"]),
            "pruner={type: none}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def states():
        # only once the sweep's first trial has started: loading a study from a database the sweep is still creating
        # would create Optuna's tables beside it, and one of the two would fail on a UNIQUE constraint
        if not (out / "kill" / "trial_0000").exists():
            return []
        try:
            return [t.state.name for t in optuna.load_study(study_name="kill", storage=storage).trials]
        except Exception:       # the study may not exist yet
            return []

    def running_has_heartbeat():
        # Optuna writes a trial's first heartbeat from a thread started after the trial is RUNNING; a worker killed
        # before that leaves no heartbeat for a later run to find stale, so the kill waits for that first row
        import sqlite3
        from contextlib import closing
        try:
            with closing(sqlite3.connect(out / "optuna.db")) as db:
                return db.execute("SELECT COUNT(*) FROM trial_heartbeats JOIN trials USING (trial_id) "
                                  "WHERE trials.state = 'RUNNING'").fetchone()[0] > 0
        except sqlite3.OperationalError:    # the sweep is writing (locked) or has not made its tables yet
            return False

    deadline = time.time() + 300
    while time.time() < deadline and not (states().count("COMPLETE") >= 1 and "RUNNING" in states()
                                          and running_has_heartbeat()):
        assert p.poll() is None, "the sweep ended before it could be killed"
        time.sleep(0.05)
    # kill at once: a tiny trial can finish within a couple of seconds, and the point is a trial still RUNNING
    p.send_signal(signal.SIGKILL)
    p.wait()
    before = optuna.load_study(study_name="kill", storage=storage).trials
    done_before = {t.number for t in before if t.state.name == "COMPLETE"}
    killed = [t.number for t in before if t.state.name == "RUNNING"]
    assert done_before and len(killed) == 1
    time.sleep(4)                                   # let the heartbeat go stale (grace_period=3 s)
    q = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert q.returncode == 0, q.stderr[-2000:]
    after = {t.number: t.state.name for t in optuna.load_study(study_name="kill", storage=storage).trials}
    assert all(after[n] == "COMPLETE" for n in done_before)        # finished trials survive
    assert after[killed[0]] == "FAIL"                                # the interrupted one is failed
    assert sum(s in ("COMPLETE", "PRUNED") for s in after.values()) == 3   # and the study reached its total


def test_a_trial_killed_before_its_first_heartbeat_is_failed_and_retried(tmp_path):
    """A worker killed after its trial turned RUNNING but before Optuna's heartbeat thread wrote a row leaves a
    trial no stale check can find. The sweep's check gives such a trial one heartbeat, so it goes stale after the
    grace period like any killed trial, while a live trial that keeps beating stays RUNNING."""
    import time

    from domino_lab.sweep.runner import fail_stale_trials

    storage = sweep_storage(f"sqlite:///{tmp_path / 'optuna.db'}", heartbeat_interval=1, grace_period=1,
                            heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1))
    study = optuna.create_study(study_name="window", storage=storage)
    dead = study.ask()                  # RUNNING with no heartbeat: its worker died at once
    live = study.ask()
    storage.record_heartbeat(live._trial_id)
    fail_stale_trials(study)
    assert [t.state.name for t in study.get_trials()] == ["RUNNING", "RUNNING"]     # not before the grace period
    for _ in range(5):                  # 2.5 s > grace: the live trial beats every 0.5 s, the dead one never
        time.sleep(0.5)
        storage.record_heartbeat(live._trial_id)
        fail_stale_trials(study)
    states = {t.number: t.state.name for t in study.get_trials()}
    assert states[dead.number] == "FAIL" and states[live.number] == "RUNNING"
    retry = [t for t in study.get_trials() if t.system_attrs.get("failed_trial") == dead.number]
    assert len(retry) == 1 and retry[0].state.name == "WAITING"
    # the retry inherits the dead trial's system attributes, the heartbeat mark included: when it runs and its own
    # worker dies just as early, it must still go stale
    again = study.ask()
    assert again.number == retry[0].number
    fail_stale_trials(study)
    time.sleep(2.5)                     # SQLite keeps heartbeats to the second: grace + 1 s is surely stale
    fail_stale_trials(study)
    assert study.get_trials()[again.number].state.name == "FAIL"


def test_a_restarted_worker_runs_the_retry_of_a_trial_that_goes_stale_while_it_works(sweep_yaml, capsys, tmp_path):
    """A worker restarted before its killed predecessor's trial is stale counts that trial as booked and plans one
    trial fewer; when the trial goes stale during its run (failed, queued again), the worker runs the retry too,
    and the study reaches its total in this one run instead of the next."""
    from domino_lab.sweep.runner import mark_beaten

    path, _ = sweep_yaml
    out = tmp_path / "restart"
    args = ["--config", str(path), "study_name=restart", f"out_dir={out}", "n_trials=5", "total_trials=2",
            "heartbeat_interval=1", "grace_period=1"]
    code, _, err = run(args + ["--prepare-only"], capsys)
    assert code == 0, err[-2000:]
    storage = sweep_storage(f"sqlite:///{out / 'optuna.db'}", heartbeat_interval=1, grace_period=1,
                            heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1))
    study = optuna.load_study(study_name="restart", storage=storage)
    killed = study.ask()                # the killed worker's trial (the queued baseline), beaten as its objective would
    mark_beaten(study, killed._trial_id)
    code, _, err = run(args, capsys)    # at once: the trial is stale only after the new worker's first trial began
    assert code == 0, err[-2000:]
    trials = optuna.load_study(study_name="restart", storage=storage).trials
    assert trials[killed.number].state.name == "FAIL"
    retry = [t for t in trials if t.system_attrs.get("failed_trial") == killed.number]
    # the retry was queued after this worker's first trial had started (numbered after it), and was run
    assert len(retry) == 1 and retry[0].number == 2 and retry[0].state.name == "COMPLETE"
    assert [t.state.name for t in trials].count("COMPLETE") == 2


def test_the_report_names_trials_still_running_and_what_ends_them(tmp_path):
    """A worker that finishes while a trial still runs (another worker's, or a dead worker's not yet stale) writes
    a study that is not done: its answer says which trials hold it and what ends a dead one."""
    from domino_lab.sweep.config import ConfirmOptions, SweepConfig
    from domino_lab.sweep.report import write_report

    study = optuna.create_study(study_name="s", storage=f"sqlite:///{tmp_path / 'o.db'}")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    parent = client.create_run(client.create_experiment("e")).info.run_id
    sweep = SweepConfig(study_name="s", grace_period=45, confirm=ConfirmOptions(seeds=2))
    done = write_report(study, sweep, tmp_path / "out", client, parent, uri, "sqlite:///o.db")
    assert "RUNNING" not in done["answer"]
    study.ask()
    study.ask()
    running = write_report(study, sweep, tmp_path / "out", client, parent, uri, "sqlite:///o.db")
    assert "Trials 1, 2 still RUNNING" in running["answer"] and "45 s old" in running["answer"]
    assert "confirmed" in running["answer"] and running["answer"] in (tmp_path / "out" / "summary.md").read_text()


def test_everything_lands_under_runs_dir(tmp_path):
    """Run from another directory with --runs-dir X: the study, the MLflow store and its artifacts, the training
    data (regenerated on first use), the trials and the report all land under X; nothing in the current directory
    (no ./runs, no ./mlruns), and the recipe-relative paths do not depend on where the command runs."""
    path, _ = tiny_sweep_yaml(tmp_path / "cfg", n_trials=3, data_path="runs/regenerated/tiny", out_dir=None)
    cwd, x = tmp_path / "elsewhere", tmp_path / "X"
    cwd.mkdir()
    r = subprocess.run([sys.executable, "-m", "domino_lab.sweep", "--config", str(path), "--n-trials", "3",
                        "--runs-dir", str(x), "--threads", "1"], cwd=cwd, capture_output=True, text=True,
                       timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert not list(cwd.iterdir()), f"written to the current directory: {list(cwd.iterdir())}"
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{x / 'optuna.db'}")
    assert len(study.trials) == 3
    assert (x / "regenerated" / "tiny" / "meta.json").exists()                # data made by the sweep, under X
    done = [t for t in study.trials if t.state.name == "COMPLETE"]
    assert done and all(Path(t.user_attrs["best_dir"]).is_relative_to(x) for t in done)
    assert (x / "tiny" / "summary.md").exists() and (x / "tiny" / "plots" / "optimization_history.png").exists()
    client = MlflowClient(f"sqlite:///{x / 'mlflow.db'}")
    exp = client.get_experiment_by_name("domino-lab-sweeps")
    assert exp.artifact_location == (x / "mlartifacts" / "domino-lab-sweeps").as_uri()
    parent = study.user_attrs["mlflow_parent_run_id"]
    assert {a.path for a in client.list_artifacts(parent)} >= {"summary.md", "plots"}
    assert list((x / "mlartifacts").rglob("summary.md"))                       # the artifacts' bytes are under X



def test_get_or_create_survives_lost_races(tmp_path, monkeypatch):
    """Workers starting together: the other worker creates the MLflow experiment between our lookup and our
    insert, or the study between Optuna's lookup and its insert; both are read back instead of failing."""
    from domino_lab.sweep import load_sweep
    from domino_lab.sweep.runner import SweepRunner

    spec = {"base_config": None, "space": {"drafter.rank": {"type": "int", "low": 4, "high": 16}},
            "out_dir": str(tmp_path / "sw"), "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    runner = SweepRunner(load_sweep(tmp_path / "s.yaml"))
    other = MlflowClient(runner.tracking_uri).create_experiment("domino-lab-sweeps")
    real = runner.client.get_experiment_by_name
    calls = []

    def stale_lookup(name):          # the first lookup happened before the other worker's insert
        calls.append(name)
        return None if len(calls) == 1 else real(name)

    monkeypatch.setattr(runner.client, "get_experiment_by_name", stale_lookup)
    assert runner._experiment_id() == other and len(calls) == 2

    first = runner._study()

    def lost(*a, **k):
        raise optuna.exceptions.DuplicatedStudyError("created by another worker")

    monkeypatch.setattr(optuna, "create_study", lost)
    assert runner._study().study_name == first.study_name


def test_parent_run_tags_survive_a_lost_insert_race(tmp_path, capsys):
    """Two workers finishing together both write the parent run's best_trial tag; MLflow's SQL store writes a
    tag as read-then-insert, so the slower one can hit the primary key the faster one just inserted. The write
    is tried again (the row now exists, so it updates); a write that keeps failing is reported, never raised."""
    from mlflow.exceptions import MlflowException

    from domino_lab.sweep.report import log_to_shared_run

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.create_run(client.create_experiment("race")).info.run_id
    client.set_tag(run, "best_trial", "3")      # the other worker's insert
    attempts = []

    def racing_set_tag(run_id, key, value):
        attempts.append(value)
        if len(attempts) == 1:
            raise MlflowException('duplicate key value violates unique constraint "tag_pk"')
        client.set_tag(run_id, key, value)

    assert log_to_shared_run(racing_set_tag, run, "best_trial", "5")
    assert len(attempts) == 2 and client.get_run(run).data.tags["best_trial"] == "5"

    def always_fails(run_id, key, value):
        raise MlflowException("database is locked\nmore detail")

    assert not log_to_shared_run(always_fails, run, "best/tau", 1.0)
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "[sweep] could not log best/tau on the parent run: database is locked"


def test_sqlite_storage_folder_is_made(tmp_path):
    """SQLite creates no folders: a new one in a --storage URL is made when the worker starts, as MLflow's store
    makes its own, instead of failing after the data has been prepared."""
    from domino_lab.sweep.config import load_sweep
    from domino_lab.sweep.runner import SweepRunner

    (tmp_path / "s.yaml").write_text(yaml.safe_dump(
        {"base_config": None, "space": {"drafter.rank": {"type": "int", "low": 4, "high": 16}}}))
    db = tmp_path / "new" / "deeper" / "optuna.db"
    sweep = load_sweep(tmp_path / "s.yaml", [f"storage=sqlite:///{db}"], runs_dir=tmp_path / "runs")
    SweepRunner(sweep)
    assert db.parent.is_dir()
