"""MLflow through Lightning's MLFlowLogger, always with an explicit tracking URI (mlflow 3 refuses the old
file store), one run per training directory so that `--resume` continues the same run."""
from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from pathlib import Path

from ..errors import UserError, atomic_path, file_lock, mask_credentials

SQLITE = "sqlite:///"
RUN_FILE = "mlflow_run.json"      # the MLflow run of a training directory, continued by --resume


def default_tracking_uri(runs_dir: str | Path | None = None) -> str:
    """sqlite:///<runs_dir>/mlflow.db, runs_dir defaulting to <repository>/runs (not the current directory)."""
    from ..config import default_runs_dir

    root = Path(runs_dir).expanduser() if runs_dir is not None else default_runs_dir()
    root.mkdir(parents=True, exist_ok=True)
    return f"{SQLITE}{(root / 'mlflow.db').resolve()}"


def mlflow_key(name: str) -> str:
    """`name` with every character MLflow refuses in a param or metric key (it takes letters, digits and `_-. /`)
    replaced by `_`: labels such as a bench's `domino+lookup` come from the command line."""
    return re.sub(r"[^A-Za-z0-9_\-. /]", "_", name)


def check_tracking_uri(uri: str | None, flag: str = "tracking URI") -> None:
    """A tracking URI MLflow has a store for (sqlite:///..., postgresql://..., http(s)://...), checked by its scheme
    without opening the store, and for a store on this machine, a place it can be created: a typo or an unwritable
    path fails before any training, sweep or bench starts, not when the results are logged. None: the default
    store. `flag`: how the caller's command line names it."""
    if uri is None:
        return
    from urllib.parse import urlparse

    from ..errors import check_out_dir, check_out_file

    if uri.startswith(SQLITE) and uri[len(SQLITE):] not in ("", ":memory:"):
        check_out_file(uri[len(SQLITE):], flag)
    elif urlparse(uri).scheme in ("", "file"):
        # MLflow 3 opens a folder store only when this variable asks it to
        if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("true", "1"):
            raise UserError(f"{flag} {uri}: MLflow no longer opens a folder as its store; use "
                            "sqlite:///PATH/mlflow.db (or set MLFLOW_ALLOW_FILE_STORE=true)")
        check_out_dir(urlparse(uri).path if uri.startswith("file:") else uri, flag)
    from mlflow.exceptions import MlflowException

    try:
        from mlflow.tracking._tracking_service.utils import _tracking_store_registry as registry
    except ImportError:      # another MLflow layout: the store itself will say
        return
    try:
        registry.get_store_builder(uri)
    except MlflowException:
        scheme = uri.split(":", 1)[0] if ":" in uri else uri
        raise UserError(mask_credentials(f"tracking URI {uri!r}: MLflow has no store for '{scheme}'; use "
                                         "sqlite:///PATH/mlflow.db, postgresql://... or "
                                         "http(s)://SERVER")) from None


def default_artifact_location(experiment: str, tracking_uri: str | None = None,
                              runs_dir: str | Path | None = None) -> str | None:
    """Where a new experiment keeps its artifacts: next to a SQLite store (<store's folder>/mlartifacts/<experiment>),
    under the runs folder for another database store (<runs_dir>/mlartifacts/<experiment>; default
    <repository>/runs), and wherever a tracking server decides (None). MLflow's own default would be ./mlruns of
    whatever directory the process happens to run in."""
    uri = tracking_uri or default_tracking_uri(runs_dir)
    if uri.startswith(SQLITE):
        return (Path(uri[len(SQLITE):]).resolve().parent / "mlartifacts" / experiment).as_uri()
    if uri.split(":", 1)[0].split("+", 1)[0] in ("postgresql", "mysql", "mssql", "sqlite"):
        from ..config import default_runs_dir

        root = Path(runs_dir).expanduser().resolve() if runs_dir is not None else default_runs_dir()
        return (root / "mlartifacts" / experiment).as_uri()
    return None


def make_logger(tracking_uri: str | None, experiment: str, run_name: str | None, out_dir: Path,
                resume: bool, tags: dict | None = None):
    from lightning.pytorch.loggers import MLFlowLogger

    uri = tracking_uri or default_tracking_uri()
    run_id = read_run_id(out_dir) if resume else None
    if run_id is not None:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        try:
            run = MlflowClient(uri).get_run(run_id)
        except MlflowException:
            raise UserError(mask_credentials(
                f"--resume: the MLflow run {run_id} recorded in {out_dir / RUN_FILE} is not in the tracking store "
                f"{uri}; resume with the tracking_uri the run was logged to, or delete {RUN_FILE} to continue in "
                "a new MLflow run")) from None
        if run.info.lifecycle_stage == "deleted":       # (MLflow refuses every write to a deleted run)
            raise UserError(mask_credentials(
                f"--resume: the MLflow run {run_id} recorded in {out_dir / RUN_FILE} was deleted from the tracking "
                f"store {uri}; restore it (mlflow runs restore --run-id {run_id}), or delete {RUN_FILE} to continue "
                "in a new MLflow run"))
    if not resume:
        end_abandoned_run(uri, out_dir)
    ensure_experiment(uri, experiment)
    logger = MLFlowLogger(experiment_name=experiment, run_name=run_name, tracking_uri=uri, run_id=run_id,
                          tags=tags, artifact_location=default_artifact_location(experiment, uri))
    return logger


@contextmanager
def _store_lock(uri: str):
    """Several processes opening a new SQLite store at once each create its schema, and all but one die on "table
    experiments already exists": a SQLite store is opened under a file lock beside it (other stores: no lock)."""
    if not uri.startswith(SQLITE):
        yield
        return
    db = Path(uri[len(SQLITE):])
    with file_lock(db.parent / f".{db.name}.lock"):
        yield


def _store_error(uri: str, e: Exception) -> UserError:
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return UserError(mask_credentials(f"cannot use the MLflow tracking store {uri}: {first}; start its server, "
                                      "repair or move the database, or choose another tracking URI"))


def open_tracking_store(uri: str):
    """An MlflowClient on `uri`, after one read from the store (a new SQLite store gets its tables here): an
    unreachable server or a damaged database is one UserError before the caller creates a folder, a study or a
    run, not a traceback half-way through."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient
    from sqlalchemy.exc import SQLAlchemyError

    try:
        with _store_lock(uri):
            client = MlflowClient(uri)
            client.search_experiments(max_results=1)
    except (MlflowException, SQLAlchemyError) as e:
        raise _store_error(uri, e) from None
    return client


def ensure_experiment(uri: str, experiment: str) -> str:
    """The experiment's id, creating the experiment (and a fresh SQLite store's tables) if needed.

    Several trainings started at once on a new store otherwise race: each one creates the SQLite schema or the
    experiment, and all but one die on "table experiments already exists" / a UNIQUE violation. A SQLite store is
    initialised under a file lock beside it; any store answers a lost creation race by reading the winner's id."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient
    from sqlalchemy.exc import SQLAlchemyError

    def get_or_create() -> str:
        client = MlflowClient(uri)
        found = client.get_experiment_by_name(experiment)
        if found is not None:
            return found.experiment_id
        try:
            return client.create_experiment(experiment, artifact_location=default_artifact_location(experiment, uri))
        except MlflowException:
            found = client.get_experiment_by_name(experiment)
            if found is None:
                raise
            return found.experiment_id

    try:
        with _store_lock(uri):
            return get_or_create()
    except (MlflowException, SQLAlchemyError) as e:     # unreachable, or a damaged database
        raise _store_error(uri, e) from None


def end_abandoned_run(uri: str, out_dir: Path) -> None:
    """A fresh run in a folder whose earlier run was killed before its first checkpoint (SIGKILL, a lost machine:
    nothing marked it ended) marks that run KILLED: it can no longer be resumed, and MLflow would list it as
    running for ever. A record that is damaged or names a run of another store is left alone."""
    try:
        run_id = read_run_id(out_dir)
    except UserError:
        return
    if run_id is not None:
        from mlflow.tracking import MlflowClient

        end_if_running(MlflowClient(uri), run_id, "KILLED")


def end_run(client, run_id: str, status: str, state: str | None = None) -> None:
    """End an MLflow run that did not complete (`status` KILLED or FAILED), tagged with its Optuna trial's `state`
    if given. Called while a failure is being handled: a store that refuses is reported, not raised over it."""
    import sys

    from mlflow.exceptions import MlflowException

    try:
        if state:
            client.set_tag(run_id, "optuna.state", state)
        client.set_terminated(run_id, status)
    except MlflowException as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(mask_credentials(f"[mlflow] could not mark run {run_id} {status}: {first}"), file=sys.stderr)


def end_if_running(client, run_id: str, status: str, state: str | None = None) -> None:
    """`end_run` for a run that nothing will end any more (its process was killed), if it still shows RUNNING; a run
    this store does not have (deleted, or in another store) is left alone."""
    from mlflow.exceptions import MlflowException

    try:
        running = client.get_run(run_id).info.status == "RUNNING"
    except MlflowException:
        return
    if running:
        end_run(client, run_id, status, state)


def read_run_id(out_dir: Path) -> str | None:
    """The MLflow run id a training directory recorded (None when it has no record)."""
    run_file = Path(out_dir) / RUN_FILE
    if not run_file.exists():
        return None
    try:
        run_id = json.loads(run_file.read_text())["run_id"]
        if not isinstance(run_id, str) or not run_id:
            raise ValueError
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"--resume: {run_file} is not a valid MLflow run record (empty or damaged); delete it to "
                        "continue the training in a new MLflow run") from None
    return run_id


def forget_metrics_from(client, run_id: str, step: int) -> int:
    """Delete the run's metric points logged at `step` or later; returns how many there were.

    A run killed without warning (SIGKILL, a lost machine) logged some steps after its last checkpoint, and the
    run resumed from that checkpoint logs those steps again: without this, its curves would hold two points per
    step. The points go through the tracking store's database (SQLite, PostgreSQL, ...); a tracking server has
    no call to delete metric points, so there a warning says which steps may appear twice."""
    import sys

    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    store = getattr(getattr(client, "_tracking_client", None), "store", None)
    if not isinstance(store, SqlAlchemyStore):
        print(f"warning: the tracking store cannot delete metric points; steps >= {step} logged before the run "
              "was interrupted may appear twice in MLflow", file=sys.stderr)
        return 0
    from mlflow.store.tracking.dbmodels.models import SqlLatestMetric, SqlMetric

    try:
        writing = store.ManagedSessionMaker(read_only=False)
    except TypeError:        # MLflow before read-only sessions
        writing = store.ManagedSessionMaker()
    with writing as session:
        n = (session.query(SqlMetric).filter(SqlMetric.run_uuid == run_id, SqlMetric.step >= step)
             .delete(synchronize_session=False))
        # latest_metrics (what the run's summary shows) keeps the newest remaining point of each key
        for latest in session.query(SqlLatestMetric).filter(SqlLatestMetric.run_uuid == run_id,
                                                            SqlLatestMetric.step >= step).all():
            newest = (session.query(SqlMetric)
                      .filter(SqlMetric.run_uuid == run_id, SqlMetric.key == latest.key)
                      .order_by(SqlMetric.step.desc(), SqlMetric.timestamp.desc(), SqlMetric.value.desc()).first())
            if newest is None:
                session.delete(latest)
            else:
                latest.step, latest.timestamp = newest.step, newest.timestamp
                latest.value, latest.is_nan = newest.value, newest.is_nan
    return n


def remember_run(logger, out_dir: Path) -> None:
    with atomic_path(out_dir / RUN_FILE) as tmp:
        tmp.write_text(json.dumps({"run_id": logger.run_id, "experiment_id": logger.experiment_id}))


def plot_curves(client, run_id: str, out_png: Path) -> Path | None:
    """train/loss_base, train/loss_final, train/lambda and val/tau over steps, from the run's own history."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["train/loss_base", "train/loss_final", "train/lambda", "val/tau"]
    hist = {k: client.get_metric_history(run_id, k) for k in keys}
    if not any(hist.values()):
        return None
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for k in ("train/loss_base", "train/loss_final"):
        if hist[k]:
            axes[0].plot([m.step for m in hist[k]], [m.value for m in hist[k]], label=k.split("/")[1])
    axes[0].set_title("training loss"); axes[0].set_xlabel("step"); axes[0].legend()
    if hist["train/lambda"]:
        axes[1].plot([m.step for m in hist["train/lambda"]], [m.value for m in hist["train/lambda"]])
    axes[1].set_title("λ (base-loss weight)"); axes[1].set_xlabel("step")
    if hist["val/tau"]:
        axes[2].plot([m.step for m in hist["val/tau"]], [m.value for m in hist["val/tau"]], marker="o")
    axes[2].set_title("val τ (real speculative decoding)"); axes[2].set_xlabel("step")
    fig.tight_layout()
    with atomic_path(out_png, suffix=out_png.suffix) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return out_png
