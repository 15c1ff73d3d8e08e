"""The study runner behind `python -m domino_lab.sweep`: storage, MLflow parent/child runs, the objective,
pruning, and the end-of-sweep report.

    prepare(sweep)      what every worker shares, made once (idempotent, safe when workers start together):
                        the Optuna storage and study, the baseline trial, the MLflow experiment and the study's
                        parent run, the training data
    run_worker(sweep)   prepare, then trials until this worker's budget (or the study's total) is spent; writes
                        the summary and plots and returns the summary
"""
from __future__ import annotations

import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import optuna
from lightning.pytorch.loggers import MLFlowLogger
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID
from optuna_integration import PyTorchLightningPruningCallback

from ..errors import UserError, check_out_file, file_lock, mask_credentials
from ..training.tracking import (default_artifact_location, default_tracking_uri, end_if_running, end_run,
                                 open_tracking_store)
from .config import SweepConfig, base_values, fingerprint_changes, study_fingerprint, trial_config
from .space import make_pruner, make_sampler, suggest
from .storage import sqlite_path, sweep_storage
from ..decoding.metrics import speedup_bound
from .trial import TrialProgress, confirmable, drafter_costs

DIRECTIONS = {"tau": "maximize", "draft_ms": "minimize", "draft_cost": "minimize"}
SETUP_LOCK_KEY = 0x646F6D696E6F     # pg_advisory_lock key ("domino") serialising table creation
DONE_STATES = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)   # trials that count
# ... and those that will: a worker starts no trial once these reach total_trials, so workers sharing a study overshoot
# it only by trials they start at the same moment
BOOKED_STATES = DONE_STATES + (optuna.trial.TrialState.RUNNING,)
PARENT_ATTR = "mlflow_parent_run_id"
FINGERPRINT_ATTR = "config_fingerprint"
BEATEN_ATTR = "domino_lab:has_heartbeat"     # a trial's system attribute: a heartbeat of it is on record


class StepPruningCallback(PyTorchLightningPruningCallback):
    """optuna-integration's callback reports at the *epoch*; we validate every N steps inside long epochs,
    so report at the global step instead (single-process trials; the parent class handles DDP)."""

    def on_validation_end(self, trainer, pl_module) -> None:
        if self.is_ddp_backend or trainer.sanity_checking:
            return super().on_validation_end(trainer, pl_module)
        score = trainer.callback_metrics.get(self.monitor)
        if score is None:
            return
        self._trial.report(float(score), step=trainer.global_step)
        # a trial that ran all its steps is complete whatever its last score: pruning saves nothing then, and
        # would drop a finished trial from the ranking
        if 0 < trainer.max_steps <= trainer.global_step:
            return
        if self._trial.should_prune():
            raise optuna.TrialPruned(f"pruned at step {trainer.global_step} ({self.monitor}={float(score):.3f})")


def _first_line(e: Exception) -> str:
    """An exception's first line for a one-line message, any URL password in it masked (a driver's error may
    quote the URL it was given)."""
    return mask_credentials((str(e).strip().splitlines() or [type(e).__name__])[0])


class SweepRunner:
    """One worker's view of a sweep: `prepare()` then `run_worker()` (the module functions do both)."""

    def __init__(self, sweep: SweepConfig, target=None):
        from ..target import Target

        self.sweep = sweep
        self.base = trial_config(sweep, {}, 0)
        # a target that cannot load fails before the sweep creates its folder, study and tracking store
        self.target = target or Target.from_pretrained(self.base.target, dtype=self.base.dtype)
        self.dir = Path(sweep.out_dir) / sweep.study_name
        self.storage_url = sweep.storage or f"sqlite:///{(Path(sweep.out_dir) / 'optuna.db').resolve()}"
        db = sqlite_path(self.storage_url)
        if db is not None:      # a database file whose folder cannot exist: one error before any folder is made
            check_out_file(db, "--storage")
        self.tracking_uri = sweep.tracking_uri or default_tracking_uri(sweep.runs_dir)
        # an unreachable or damaged tracking store is one error now, before the sweep's folder and study exist (a
        # new store gets its tables here: workers on one PostgreSQL database take turns)
        with self._server_locks():
            self.client = open_tracking_store(self.tracking_uri)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"cannot create sweep folder {self.dir}: {e.strerror}") from None
        if db is not None:     # SQLite does not create folders (MLflow's store does): made here, before any work
            try:
                db.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise UserError(f"cannot create the folder of Optuna storage {db}: {e.strerror}") from None
        self.study = None
        self.parent = None
        self.confirm_prompts: list[list[int]] = []

    # ---- shared state, made once --------------------------------------------------------------------
    def prepare(self) -> "SweepRunner":
        from ..data.regenerate import ensure_regenerated

        ensure_regenerated(self.base.data.path, self.target, n_math=self.sweep.regen_math,
                           n_code=self.sweep.regen_code, max_new_tokens=self.sweep.regen_max_new_tokens,
                           target_name=self.base.target, log_prefix="[sweep]")
        # the data decides whether the held-out prompts suffice: checked before any study exists
        self._prepare_features_and_prompts()
        with self._setup_lock():
            self.study = self._study()
            self._enqueue_baseline()
            # trials of a killed worker: failed (and queued again) now rather than when this worker's first trial
            # starts, so their MLflow runs are ended below even when no trial is left to run
            fail_stale_trials(self.study)
        with self._setup_lock():
            self.parent = self._parent_run()
        self._end_failed_trial_runs(self.study)
        return self

    def _end_failed_trial_runs(self, study) -> None:
        """A worker killed without warning (SIGKILL, a lost machine) leaves its trial's MLflow run RUNNING for ever;
        once the heartbeat has marked the trial FAIL, its run is ended to match."""
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.FAIL,)):
            if t.user_attrs.get("mlflow_run_id"):
                end_if_running(self.client, t.user_attrs["mlflow_run_id"], "KILLED", "FAIL")

    def _prepare_features_and_prompts(self) -> None:
        """The offline feature cache (built here, with its progress bar, rather than silently inside the first
        trial) and the held-out prompts: the search's eval.tau_prompts first, the confirmation's after them."""
        from ..training.config import drafter_config
        from ..training.datamodule import DrafterDataModule

        dm = DrafterDataModule(self.base.data, seed=self.base.seed)
        dm.setup()
        search = self.base.eval.tau_prompts
        n_confirm = self.confirm_prompts_count()
        if self.sweep.confirm.seeds and len(dm.val_rows) < search + n_confirm:
            raise UserError(f"the confirmation needs {search} + {n_confirm} held-out prompts but the validation split "
                            f"of {self.base.data.path} has {len(dm.val_rows)}; raise data.val_fraction or the "
                            "regenerated data (regen_math, regen_code), or lower eval.tau_prompts / confirm.prompts")
        self.confirm_prompts = [r["input_ids"][: r["prompt_len"]]
                                for r in dm.val_rows[search: search + n_confirm]]
        if self.base.data.features == "offline":
            from ..data.features import ensure

            taps = drafter_config(self.base.drafter, self.target).target_layer_ids
            ensure(self.target, dm.train_rows + dm.val_rows, taps, self.base.data.features_dir, progress=True)

    def confirm_prompts_count(self) -> int:
        return self.sweep.confirm.prompts or max(2, self.base.eval.tau_prompts)

    def _storage(self):
        try:
            # heartbeats let a restarted study mark trials of a killed worker as failed and retry them
            return sweep_storage(
                self.storage_url, heartbeat_interval=self.sweep.heartbeat_interval,
                grace_period=self.sweep.grace_period,
                heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1))
        except Exception as e:   # bad URL, unreachable server, missing driver: one clear line
            raise UserError(f"cannot open Optuna storage {mask_credentials(self.storage_url)}: "
                            f"{_first_line(e)}") from None

    @contextmanager
    def _setup_lock(self):
        """Workers started together on fresh databases race to create the tables (Optuna's and MLflow's), on
        PostgreSQL too ("duplicate key ... pg_type_typname_nsp_index"), the study, the experiment and the parent
        run: one at a time. A file lock covers the workers of this machine; a PostgreSQL advisory lock covers
        workers on other machines too. Every get-or-create below also survives a lost race without the lock."""
        with self._file_lock(), self._server_locks():
            yield

    def _file_lock(self):
        return file_lock(self.dir / ".setup.lock")

    @contextmanager
    def _server_locks(self):
        """A session-level pg_advisory_lock on every PostgreSQL database in use (Optuna's, and MLflow's when
        the tracking URI is a database rather than a server); closing the connection releases it."""
        import sqlalchemy as sa

        urls = sorted({u for u in (self.storage_url, self.tracking_uri) if u.startswith("postgresql")})
        conns = []
        try:
            for url in urls:
                try:
                    conn = sa.create_engine(url, poolclass=sa.pool.NullPool).connect()
                except Exception as e:   # bad URL, unreachable server, missing driver: one clear line
                    what = "Optuna storage" if url == self.storage_url else "MLflow tracking URI"
                    raise UserError(f"cannot open {what} {mask_credentials(url)}: {_first_line(e)}") from None
                conns.append(conn)
                conn.execute(sa.text("SELECT pg_advisory_lock(:key)"), {"key": SETUP_LOCK_KEY})
            yield
        finally:
            for conn in reversed(conns):
                conn.close()

    def _study(self):
        directions = [DIRECTIONS[o] for o in self.sweep.objectives]
        storage = self._storage()
        kw = dict(study_name=self.sweep.study_name, storage=storage, sampler=make_sampler(self.sweep.sampler),
                  pruner=make_pruner(self.sweep.pruner))
        try:
            study = optuna.create_study(load_if_exists=True, directions=directions, **kw)
        except optuna.exceptions.DuplicatedStudyError:
            # another worker created it between Optuna's lookup and its insert: it exists now, load it
            study = optuna.load_study(**kw)
        if [d.name.lower() for d in study.directions] != directions:
            raise UserError(f"study '{self.sweep.study_name}' exists with other objectives; use another --study-name")
        self._check_fingerprint(study)
        return study

    def _check_fingerprint(self, study) -> None:
        """A study ranks its trials against each other, so a re-run or a joining worker must measure them the same
        way: the config's fingerprint (config.study_fingerprint) is stored when the study is made and compared on
        every later use. Called under the setup lock, so workers creating the study together store it once."""
        mine = study_fingerprint(self.sweep, self.base)
        stored = study.user_attrs.get(FINGERPRINT_ATTR)
        if stored is None:      # a new study, or one made before studies kept a fingerprint: this config is its own
            study.set_user_attr(FINGERPRINT_ATTR, mine)
            return
        changes = fingerprint_changes(stored, mine)
        if changes:
            more = f" (and {len(changes) - 3} more)" if len(changes) > 3 else ""
            raise UserError(f"study '{self.sweep.study_name}' was made with another config, so its trials would not "
                            f"compare with new ones: {'; '.join(changes[:3])}{more}; use another --study-name, or "
                            "restore the config")

    def _enqueue_baseline(self) -> None:
        """Trial 0 of a new study: the base recipe's own values, the baseline to beat (called under the lock, so
        workers starting together enqueue it once)."""
        baseline = base_values(self.base, self.sweep.space)
        swept = [k for k, v in self.sweep.space.items() if v["type"] != "fixed"]
        if self.sweep.enqueue_defaults and set(baseline) == set(swept) and not self.study.trials:
            self.study.enqueue_trial(baseline, user_attrs={"baseline": True})

    def _experiment_id(self) -> str:
        name = self.sweep.experiment
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        try:
            return self.client.create_experiment(
                name, artifact_location=default_artifact_location(name, self.tracking_uri, self.sweep.runs_dir))
        except MlflowException:
            exp = self.client.get_experiment_by_name(name)    # created by another worker in the meantime
            if exp is None:
                raise
            return exp.experiment_id

    def _reload_study(self):
        return optuna.load_study(study_name=self.study.study_name, storage=self.study._storage)

    def _parent_run(self) -> str:
        run_id = self.study.user_attrs.get(PARENT_ATTR) or self._reload_study().user_attrs.get(PARENT_ATTR)
        if run_id:
            return run_id
        run = self.client.create_run(self._experiment_id(), run_name=f"study-{self.sweep.study_name}",
                                     tags={"optuna.study": self.sweep.study_name, "sweep.parent": "true"})
        self.study.set_user_attr(PARENT_ATTR, run.info.run_id)
        # a worker outside our locks (another machine on a SQLite copy, or no lock support) may have raced us:
        # whoever wrote last wins, the loser's run is marked as such
        winner = self._reload_study().user_attrs[PARENT_ATTR]
        if winner != run.info.run_id:
            self.client.set_terminated(run.info.run_id, "KILLED")
        return winner

    def _study_done(self, study) -> bool:
        return study_done(study, self.sweep.total_trials)

    def _update_parent_status(self, study) -> None:
        """The parent run is RUNNING while the study has work left (its trials, then the confirmation stage) and
        FINISHED once everything is done."""
        done = self._study_done(study) and (not self.sweep.confirm.seeds or "confirmation" in study.user_attrs
                                            or not confirmable(study))
        status = "FINISHED" if done else "RUNNING"
        try:
            if self.client.get_run(self.parent).info.status != status:
                if done:
                    self.client.set_terminated(self.parent, status)      # also records the end time
                else:
                    self.client.update_run(self.parent, status=status)
        except MlflowException as e:     # the report still stands; say why the status did not change
            print(f"[sweep] could not set the parent run's status to {status}: {_first_line(e)}", file=sys.stderr)

    # ---- one trial ------------------------------------------------------------------------------------
    def objective(self, trial):
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        mark_beaten(trial.study, trial._trial_id)
        params = suggest(trial, self.sweep.space)
        cfg = trial_config(self.sweep, params, trial.number)
        cfg.tracking_uri = self.tracking_uri
        logger = MLFlowLogger(experiment_name=self.sweep.experiment, run_name=f"trial-{trial.number}",
                              tracking_uri=self.tracking_uri,
                              tags={MLFLOW_PARENT_RUN_ID: self.parent, "optuna.study": self.sweep.study_name,
                                    "optuna.trial": str(trial.number)})
        logger.log_hyperparams({f"trial.{k}": v for k, v in params.items()})
        trial.set_user_attr("mlflow_run_id", logger.run_id)
        try:
            out = self._train_trial(trial, cfg, logger)
        except optuna.TrialPruned:
            end_run(logger.experiment, logger.run_id, "KILLED", "PRUNED")
            raise
        except SIGTERMException:
            # Optuna lets this SystemExit through and leaves the trial RUNNING until its heartbeat goes stale: it
            # is failed and queued again now, as the heartbeat would, so the command's next run starts with it
            end_run(logger.experiment, logger.run_id, "KILLED", "FAIL")
            study = trial.study
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            retry = study._storage.get_heartbeat_stale_trial_callback()
            if retry is not None:
                retry(study, study._storage.get_trial(trial._trial_id))
            raise
        except (Exception, KeyboardInterrupt):      # what Optuna marks FAIL: the MLflow run must not stay RUNNING
            end_run(logger.experiment, logger.run_id, "FAILED", "FAIL")
            raise
        logger.experiment.set_tag(logger.run_id, "optuna.state", "COMPLETE")
        return out

    def _train_trial(self, trial, cfg, logger):
        """Train one trial's drafter and measure its step costs; its objective value(s)."""
        from ..train import train

        callbacks = [StepPruningCallback(trial, monitor="val/tau")] if len(self.sweep.objectives) == 1 else []
        callbacks.append(TrialProgress(self._trial_label(trial.number), cfg.max_steps))
        res = train(cfg, extra_callbacks=callbacks, logger=logger, target=self.target)
        trial.set_user_attr("best_dir", res["best_dir"])
        trial.set_user_attr("final_dir", res.get("final_dir"))
        trial.set_user_attr("seed", cfg.seed)
        if res["best_tau"] is None:
            raise UserError("a trial finished without a validation; set eval.every_n_steps <= max_steps")
        # the step's costs measured decode-like on the side (a decode's own step times swing too much to compare
        # trials run minutes apart): the draft_ms / draft_cost objectives and the report's speedup estimate
        costs = drafter_costs(self.target, res["best_dir"])
        costs["speedup_est"] = speedup_bound(res["best_tau"], costs["step_ms"], costs["draft_ms"], costs["verify_ms"])
        for k in ("draft_ms", "verify_ms", "step_ms", "speedup_est"):
            trial.set_user_attr(k, costs[k])
            logger.experiment.log_metric(logger.run_id, f"cost/{k}", costs[k])
        values = {"tau": res["best_tau"], "draft_ms": costs["draft_ms"],
                  "draft_cost": costs["draft_ms"] / costs["step_ms"]}
        out = [values[o] for o in self.sweep.objectives]
        return out[0] if len(out) == 1 else out

    def _trial_label(self, number: int) -> str:
        total = self.sweep.total_trials or self.sweep.n_trials
        return f"trial {number} ({min(number + 1, total)}/{total})" if self.sweep.total_trials else f"trial {number}"

    def _trial_done(self, study, trial) -> None:
        """One line per finished trial, above the progress bar."""
        from tqdm.auto import tqdm

        score = f"τ = {trial.values[0]:.3f}" if trial.values else (
            f"τ = {trial.intermediate_values[max(trial.intermediate_values)]:.3f} at step "
            f"{max(trial.intermediate_values)}" if trial.intermediate_values else "no score")
        tqdm.write(f"[sweep] trial {trial.number} {trial.state.name.lower()}: {score}"
                   + (" (baseline)" if trial.user_attrs.get("baseline") else ""), file=sys.stderr)

    # ---- the worker ------------------------------------------------------------------------------------
    def run_worker(self) -> dict:
        from .report import write_report

        if self.study is None:
            self.prepare()
        study, total = self.study, self.sweep.total_trials
        n_trials = self.sweep.n_trials
        if total and len(study.get_trials(deepcopy=False, states=BOOKED_STATES)) >= total:
            n_trials = 0
        # With a total, stop_at_total ends this worker's trials once finished and running ones reach it, checked
        # after each trial: a killed worker's trial that goes stale meanwhile is failed (and queued again) there, and
        # a trial that fails frees its place, so both are run here, within the worker's own n_trials, rather than
        # by the next run. (It checks for killed workers' trials itself; without a total, the lambda does.)
        callbacks = [stop_at_total(total) if total else (lambda study, trial: fail_stale_trials(study)),
                     self._trial_done]
        try:
            if n_trials:
                self._update_parent_status(study)
                study.optimize(self.objective, n_trials=n_trials, callbacks=callbacks,
                               timeout=self.sweep.timeout_min * 60 if self.sweep.timeout_min else None,
                               catch=(RuntimeError,), gc_after_trial=True, show_progress_bar=False)
            final = self._reload_study()
            if self.sweep.confirm.seeds and self._study_done(final):
                from .confirm import run_confirmation

                run_confirmation(self, final)
                final = self._reload_study()
            # trials the heartbeat failed while this worker ran (a worker killed meanwhile)
            self._end_failed_trial_runs(final)
            summary = write_report(final, self.sweep, self.dir, self.client, self.parent, self.tracking_uri,
                                   self.storage_url, self.base.max_steps, base_cfg=self.base)
        except BaseException as e:
            # the worker ends with an error (or a signal): its parent run must not claim to be RUNNING (the next
            # worker to start sets it RUNNING again)
            end_run(self.client, self.parent, "FAILED" if isinstance(e, Exception) else "KILLED")
            raise
        self._update_parent_status(final)
        return summary


def fail_stale_trials(study) -> None:
    """Mark FAIL (and, with the retry callback, queue again) the running trials whose heartbeat is stale: their
    worker was killed. Then give a heartbeat to those that may have none (`beat_unbeaten_trials`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    beat_unbeaten_trials(study)


def beat_unbeaten_trials(study) -> None:
    """Give each running trial that may lack a heartbeat one heartbeat, once.

    Optuna's worker writes a trial's first heartbeat from a thread it starts after the trial is RUNNING, and only a
    trial with a heartbeat can go stale: a worker killed in between leaves its trial RUNNING for good, booked
    against the study's total, which then never finishes. The objective marks its trial as beaten at its first line
    (`mark_beaten`), so a RUNNING trial without the mark is one whose worker died in that moment or is about to
    reach that line: one heartbeat recorded here, and the mark, start its clock. A live trial keeps beating from
    its own worker; a dead one goes stale after the grace period and is failed and retried like any killed trial.
    Marked trials are not beaten again, or a dead one would never go stale. Stale trials were failed just before,
    so a beat here puts off a killed trial's failure only if it was killed after Optuna's first heartbeat and
    before the objective's first line, and only by one grace period."""
    if not _keeps_heartbeats(study._storage):
        return
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        if t.system_attrs.get(BEATEN_ATTR) != t._trial_id:
            mark_beaten(study, t._trial_id)


def mark_beaten(study, trial_id: int) -> None:
    """Record a heartbeat of the trial, then mark it as having one. The mark names the trial itself: Optuna's retry
    callback copies a failed trial's system attributes into its retry, which has no heartbeat of its own yet."""
    storage = study._storage
    if not _keeps_heartbeats(storage):
        return
    storage.record_heartbeat(trial_id)
    try:
        storage.set_trial_system_attr(trial_id, BEATEN_ATTR, trial_id)
    except optuna.exceptions.UpdateFinishedTrialError:     # it finished meanwhile: nothing to watch
        pass


def _keeps_heartbeats(storage) -> bool:
    return getattr(storage, "get_heartbeat_interval", lambda: None)() is not None


def stop_at_total(total_trials: int):
    """The callback that ends a worker's trials once finished and running ones reach `total_trials`. A killed
    worker's trial stops counting as running once its heartbeat is stale: it is failed (and queued again) first,
    as Optuna would at this worker's next trial."""
    def callback(study, trial) -> None:
        fail_stale_trials(study)
        if len(study.get_trials(deepcopy=False, states=BOOKED_STATES)) >= total_trials:
            study.stop()
    return callback


def study_done(study, total_trials: int | None) -> bool:
    """Every trial of the study is over: `total_trials` of them finished (without a total: none waiting), and none
    running. Another worker's running trial may yet be the best one; that worker confirms the winner when it ends."""
    running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    if total_trials:
        return not running and len(study.get_trials(deepcopy=False, states=DONE_STATES)) >= total_trials
    return not running and not study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))


def prepare(sweep: SweepConfig, target=None) -> SweepRunner:
    """Create what the workers of a sweep share (see the module docstring); running it again changes nothing.
    Returns the prepared runner, which `run_worker` can continue with."""
    return SweepRunner(sweep, target).prepare()


def run_worker(sweep: SweepConfig, runner: SweepRunner | None = None) -> dict:
    """One worker: prepare (unless `runner` is prepared already), run trials, write the report; the summary."""
    return (runner or SweepRunner(sweep)).run_worker()
