"""Base-logit loss curves from MLflow (the curriculum ablation's backbone-collapse check, the paper's Fig. 3)."""
from __future__ import annotations

from pathlib import Path

from ..errors import atomic_path


def loss_history(run_ids: list[str], metric: str = "train/loss_base", tracking_uri: str | None = None) -> dict:
    """{"steps", metric values}: the mean over runs at the steps every run logged."""
    from mlflow.tracking import MlflowClient

    from ..training.tracking import default_tracking_uri

    client = MlflowClient(tracking_uri or default_tracking_uri())
    per_run = []
    for rid in run_ids:
        hist = client.get_metric_history(rid, metric)
        per_run.append({m.step: m.value for m in hist})
    steps = sorted(set.intersection(*(set(h) for h in per_run))) if per_run else []
    return {"steps": steps, "values": [sum(h[t] for h in per_run) / len(per_run) for t in steps]}


def smooth(xs: list[float], w: int = 25) -> list[float]:
    """Trailing running mean over w points (fewer at the start)."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x - (xs[i - w] if i >= w else 0.0)
        out.append(acc / min(i + 1, w))
    return out


def plot_loss_curves(curves: dict, out_png: Path, title: str, ylabel: str, skip_steps: int = 50) -> None:
    """curves: {label: {"steps", "values"}}; the y range ignores the first `skip_steps` (the random-init CE
    would flatten the part that differs)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    tail = []
    for label, c in curves.items():
        ys = smooth(c["values"])
        ax.plot(c["steps"], ys, label=label)
        tail += [v for t, v in zip(c["steps"], ys) if t >= skip_steps]
    if tail:
        ax.set_ylim(min(tail) - 0.2, max(tail) + 0.2)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    with atomic_path(out_png, suffix=Path(out_png).suffix) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
