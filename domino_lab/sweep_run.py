"""The study runner behind `python -m domino_lab.sweep`: storage, MLflow parent/child runs, the objective,
pruning, and the end-of-sweep report (plots, summary, the answer)."""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import optuna
from lightning.pytorch.loggers import MLFlowLogger
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID
from optuna_integration import PyTorchLightningPruningCallback

from .errors import UserError
from .sweep import base_values, ensure_training_data, trial_config
from .sweep_space import make_pruner, make_sampler, suggest
from .training.tracking import default_artifact_location, default_tracking_uri

DIRECTIONS = {"tau": "maximize", "draft_ms": "minimize"}
SETUP_LOCK_KEY = 0x646F6D696E6F     # pg_advisory_lock key ("domino") serialising table creation


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
        if self._trial.should_prune():
            raise optuna.TrialPruned(f"pruned at step {trainer.global_step} ({self.monitor}={float(score):.3f})")


def plain_step_ms(target, cfg, n_prompts: int = 3, new_tokens: int = 32) -> float:
    """Plain greedy decoding: ms per target step on validation prompts (the speedup baseline)."""
    from .decoding import speculative_generate
    from .training.datamodule import DrafterDataModule

    dm = DrafterDataModule(cfg.data, seed=cfg.seed)
    dm.setup()
    prompts = dm.tau_prompts(n_prompts)
    speculative_generate(target, None, prompt_ids=prompts[0], max_new_tokens=4)      # warm-up
    steps = [s for p in prompts for s in speculative_generate(target, None, prompt_ids=p,
                                                              max_new_tokens=new_tokens).steps]
    return 1000 * sum(s.verify_time_s for s in steps) / max(1, len(steps))


class SweepRunner:
    def __init__(self, sweep):
        self.sweep = sweep
        self.dir = Path(sweep.out_dir) / sweep.study_name
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"cannot create sweep folder {self.dir}: {e.strerror}") from None
        self.storage_url = sweep.storage or f"sqlite:///{(Path(sweep.out_dir) / 'optuna.db').resolve()}"
        self.tracking_uri = sweep.tracking_uri or default_tracking_uri()
        with self._setup_lock():
            self.client = MlflowClient(self.tracking_uri)      # creates MLflow's tables if the file is new
        self.target = None
        self.t_ar_ms = None

    # ---- setup -----------------------------------------------------------------------------------
    def _storage(self):
        try:
            # heartbeats let a restarted study mark trials of a killed worker as failed and retry them
            return optuna.storages.RDBStorage(
                self.storage_url, heartbeat_interval=self.sweep.heartbeat_interval,
                grace_period=self.sweep.grace_period,
                heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1))
        except Exception as e:   # bad URL, unreachable server, missing driver: one clear line
            raise UserError(f"cannot open Optuna storage {self.storage_url}: {str(e).splitlines()[0]}") from None

    @contextmanager
    def _setup_lock(self):
        """Workers started together on fresh databases race to create the tables (Optuna's and MLflow's), on
        PostgreSQL too ("duplicate key ... pg_type_typname_nsp_index"): one at a time. A file lock covers the
        workers of this machine; a PostgreSQL advisory lock covers workers on other machines too."""
        with self._file_lock(), self._server_locks():
            yield

    @contextmanager
    def _file_lock(self):
        try:
            import fcntl
        except ImportError:      # not POSIX: no lock
            yield
            return
        with open(self.dir / ".setup.lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

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
                    raise UserError(f"cannot open {what} {url}: {str(e).strip().splitlines()[0]}") from None
                conns.append(conn)
                conn.execute(sa.text("SELECT pg_advisory_lock(:key)"), {"key": SETUP_LOCK_KEY})
            yield
        finally:
            for conn in reversed(conns):
                conn.close()

    def _study(self):
        directions = [DIRECTIONS[o] for o in self.sweep.objectives]
        study = optuna.create_study(study_name=self.sweep.study_name, storage=self._storage(),
                                    load_if_exists=True, directions=directions,
                                    sampler=make_sampler(self.sweep.sampler), pruner=make_pruner(self.sweep.pruner))
        if [d.name.lower() for d in study.directions] != directions:
            raise UserError(f"study '{self.sweep.study_name}' exists with other objectives; use another --study-name")
        return study

    def _parent_run(self, study) -> str:
        run_id = study.user_attrs.get("mlflow_parent_run_id")
        if run_id:
            return run_id
        exp = self.client.get_experiment_by_name(self.sweep.experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(
            self.sweep.experiment, artifact_location=default_artifact_location(self.sweep.experiment)
            if self.tracking_uri.startswith("sqlite") else None)
        run = self.client.create_run(exp_id, run_name=f"study-{self.sweep.study_name}",
                                     tags={"optuna.study": self.sweep.study_name, "sweep.parent": "true"})
        study.set_user_attr("mlflow_parent_run_id", run.info.run_id)
        # another worker may have raced us: whoever wrote last wins, the loser's run is marked as such
        winner = optuna.load_study(study_name=study.study_name, storage=study._storage).user_attrs[
            "mlflow_parent_run_id"]
        if winner != run.info.run_id:
            self.client.set_terminated(run.info.run_id, "KILLED")
        return winner

    # ---- one trial -----------------------------------------------------------------------------
    def objective(self, trial, parent: str):
        from .train import train

        params = suggest(trial, self.sweep.space)
        cfg = trial_config(self.sweep, params, trial.number)
        cfg.tracking_uri = self.tracking_uri
        logger = MLFlowLogger(experiment_name=self.sweep.experiment, run_name=f"trial-{trial.number}",
                              tracking_uri=self.tracking_uri,
                              tags={MLFLOW_PARENT_RUN_ID: parent, "optuna.study": self.sweep.study_name,
                                    "optuna.trial": str(trial.number)})
        logger.log_hyperparams({f"trial.{k}": v for k, v in params.items()})
        trial.set_user_attr("mlflow_run_id", logger.run_id)
        callbacks = [StepPruningCallback(trial, monitor="val/tau")] if len(self.sweep.objectives) == 1 else []
        try:
            res = train(cfg, extra_callbacks=callbacks, logger=logger, target=self.target)
        except optuna.TrialPruned:
            logger.experiment.set_tag(logger.run_id, "optuna.state", "PRUNED")
            logger.experiment.set_terminated(logger.run_id, "KILLED")
            raise
        logger.experiment.set_tag(logger.run_id, "optuna.state", "COMPLETE")
        trial.set_user_attr("best_dir", res["best_dir"])
        if res["best_tau"] is None:
            raise UserError("a trial finished without a validation; set eval.every_n_steps <= max_steps")
        values = {"tau": res["best_tau"], "draft_ms": res["best_draft_ms"]}
        if self.t_ar_ms and res.get("best_draft_ms") is not None and res.get("best_verify_ms") is not None:
            # cost model (DESIGN §2 / paper §4): tokens per step × plain step time / speculative step time
            trial.set_user_attr("speedup_est", res["best_tau"] * self.t_ar_ms /
                                (res["best_draft_ms"] + res["best_verify_ms"]))
        out = [values[o] for o in self.sweep.objectives]
        return out[0] if len(out) == 1 else out

    # ---- the study -----------------------------------------------------------------------------
    def run(self) -> dict:
        from .target import Target

        with self._setup_lock():
            study = self._study()
        base = trial_config(self.sweep, {}, 0)
        self.target = Target.from_pretrained(base.target, dtype=base.dtype)
        ensure_training_data(base, self.target, self.sweep)
        self.t_ar_ms = plain_step_ms(self.target, base)
        parent = self._parent_run(study)
        baseline = base_values(base, self.sweep.space)
        swept = [k for k, v in self.sweep.space.items() if v["type"] != "fixed"]
        if self.sweep.enqueue_defaults and set(baseline) == set(swept):
            with self._setup_lock():             # workers starting together: one of them enqueues it
                if not study.trials:
                    study.enqueue_trial(baseline, user_attrs={"baseline": True})
        finished = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
        n_trials, callbacks = self.sweep.n_trials, []
        if self.sweep.total_trials:
            n_trials = max(0, min(n_trials, self.sweep.total_trials - len(study.get_trials(states=finished))))
            callbacks.append(optuna.study.MaxTrialsCallback(self.sweep.total_trials, states=finished))
        if n_trials:
            study.optimize(lambda t: self.objective(t, parent), n_trials=n_trials, callbacks=callbacks,
                           timeout=self.sweep.timeout_min * 60 if self.sweep.timeout_min else None,
                           catch=(RuntimeError,), gc_after_trial=True, show_progress_bar=True)
        from .sweep_report import write_report

        return write_report(optuna.load_study(study_name=study.study_name, storage=study._storage), self.sweep,
                            self.dir, self.client, parent, self.tracking_uri, self.storage_url, base.max_steps)
