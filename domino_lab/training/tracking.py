"""MLflow through Lightning's MLFlowLogger, always with an explicit tracking URI (mlflow 3 refuses the old
file store), one run per training directory so that `--resume` continues the same run."""
from __future__ import annotations

import json
from pathlib import Path

REPO_RUNS = Path.cwd() / "runs"


def default_tracking_uri() -> str:
    REPO_RUNS.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{(REPO_RUNS / 'mlflow.db').resolve()}"


def default_artifact_location(experiment: str) -> str:
    return (REPO_RUNS / "mlartifacts" / experiment).resolve().as_uri()


def make_logger(tracking_uri: str | None, experiment: str, run_name: str | None, out_dir: Path,
                resume: bool, tags: dict | None = None):
    from lightning.pytorch.loggers import MLFlowLogger

    uri = tracking_uri or default_tracking_uri()
    run_file = out_dir / "mlflow_run.json"
    run_id = json.loads(run_file.read_text())["run_id"] if resume and run_file.exists() else None
    logger = MLFlowLogger(experiment_name=experiment, run_name=run_name, tracking_uri=uri, run_id=run_id,
                          tags=tags, artifact_location=default_artifact_location(experiment)
                          if uri.startswith("sqlite") else None)
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
