"""MLflow through Lightning's MLFlowLogger, always with an explicit tracking URI (mlflow 3 refuses the old
file store), one run per training directory so that `--resume` continues the same run."""
from __future__ import annotations

import json
from pathlib import Path

SQLITE = "sqlite:///"


def default_tracking_uri(runs_dir: str | Path | None = None) -> str:
    """sqlite:///<runs_dir>/mlflow.db, runs_dir defaulting to <repository>/runs (not the current directory)."""
    from ..config import default_runs_dir

    root = Path(runs_dir).expanduser() if runs_dir is not None else default_runs_dir()
    root.mkdir(parents=True, exist_ok=True)
    return f"{SQLITE}{(root / 'mlflow.db').resolve()}"


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
    run_file = out_dir / "mlflow_run.json"
    run_id = json.loads(run_file.read_text())["run_id"] if resume and run_file.exists() else None
    logger = MLFlowLogger(experiment_name=experiment, run_name=run_name, tracking_uri=uri, run_id=run_id,
                          tags=tags, artifact_location=default_artifact_location(experiment, uri))
    return logger


def remember_run(logger, out_dir: Path) -> None:
    (out_dir / "mlflow_run.json").write_text(json.dumps({"run_id": logger.run_id,
                                                         "experiment_id": logger.experiment_id}))


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
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
