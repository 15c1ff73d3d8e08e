"""Training curves from MLflow: the base-logit loss (the curriculum ablation's backbone-collapse check, the paper's
Fig. 3) and validation τ / acceptance against steps (has a run converged?)."""
from __future__ import annotations

import math
from collections import deque
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
    """Trailing running mean over the last w points (fewer at the start). A NaN point (a step whose loss was not
    finite) is skipped: in the running sum it would blank the rest of the curve."""
    out, window, acc = [], deque(), 0.0
    for x in xs:
        if not math.isnan(x):
            window.append(x)
            acc += x
            if len(window) > w:
                acc -= window.popleft()
        out.append(acc / len(window) if window else math.nan)
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
        tail += [v for t, v in zip(c["steps"], ys) if t >= skip_steps and not math.isnan(v)]
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


def convergence_curves(run_dirs: dict, tracking_uri: str | None = None) -> dict:
    """{label: {"steps", "tau", "accept"}} for the training runs in `run_dirs` ({label: run folder with the
    mlflow_run.json that domino_lab.train writes}; folders without one are skipped): val/tau and val/accept_pos_i
    (acceptance of draft i given drafts < i were accepted, from real decoding of the validation prompts) for i < 3 at
    every evaluation."""
    import json

    from mlflow.tracking import MlflowClient

    from ..training.tracking import default_tracking_uri

    client = MlflowClient(tracking_uri or default_tracking_uri())
    out = {}
    for label, folder in run_dirs.items():
        f = Path(folder) / "mlflow_run.json"
        if not f.exists():
            continue
        rid = json.loads(f.read_text())["run_id"]
        tau = {m.step: m.value for m in client.get_metric_history(rid, "val/tau")}
        acc = [{m.step: m.value for m in client.get_metric_history(rid, f"val/accept_pos_{i}")} for i in range(3)]
        out[label] = {"steps": sorted(tau), "tau": [tau[t] for t in sorted(tau)],
                      "accept": [[a.get(t) for t in sorted(tau)] for a in acc]}
    return out


def plot_convergence(curves: dict, out_png: Path) -> None:
    """Val τ (left) and the acceptance of drafts 0-2 (right) against training steps, one colour per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for r, c in curves.items():
        line, = a1.plot([s + 1 for s in c["steps"]], c["tau"], marker="o", label=r)
        for i, (acc, style) in enumerate(zip(c["accept"], ("-", "--", ":"))):
            a2.plot([s + 1 for s in c["steps"]], acc, style, color=line.get_color(), label=f"{r} draft {i}")
    a1.set(xlabel="training step", ylabel="val τ (greedy, real decoding)", title="τ on validation prompts")
    a2.set(xlabel="training step", ylabel="acceptance rate", title="acceptance of drafts 0-2 (given the earlier ones)")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(out_png, suffix=Path(out_png).suffix) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
