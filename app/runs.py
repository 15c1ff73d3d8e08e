"""The Runs view: τ and per-position acceptance curves of MLflow runs (training runs and sweep trials).

Reads what training logged (`val/tau`, `val/best_tau`, `val/accept_pos_{k}`; sweeps: one parent run tagged
`sweep.parent`, one nested run per trial). A missing or empty store gives a message, never an error, and a
missing sqlite file is not created.
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

ACCEPT_RE = re.compile(r"^val/accept_pos_(\d+)$")
FILL_HINT = ("train a drafter (`python -m domino_lab.train --config experiments/configs/domino.yaml`) or run a "
             "sweep (`python -m domino_lab.sweep`) to fill it")


@dataclass
class RunInfo:
    run_id: str
    name: str
    experiment: str
    study: str | None           # the Optuna study of a sweep trial or parent
    parent_id: str | None
    is_sweep_parent: bool
    method: str | None
    tau: float | None           # best validation τ (val/best_tau, else the last val/tau)
    start_time: int
    checkpoint: Path | None     # a local drafter directory for this run (its best export), if one exists

    @property
    def label(self) -> str:
        where = f"sweep {self.study}" if self.study and not self.is_sweep_parent else self.experiment
        tau = f" · val τ {self.tau:.3f}" if self.tau is not None else ""
        return f"{where} / {self.name}{tau}"


def sqlite_path(tracking_uri: str) -> Path | None:
    if tracking_uri.startswith("sqlite:///"):
        return Path(tracking_uri[len("sqlite:///"):])
    return None


def store_problem(tracking_uri: str | None) -> str | None:
    """Why there is nothing to read (no store configured, sqlite file absent), or None."""
    if not tracking_uri:
        return f"No MLflow store is configured (`--tracking-uri`); {FILL_HINT}."
    path = sqlite_path(tracking_uri)
    if path is not None and not path.is_file():
        return f"No MLflow store at `{path}` yet: {FILL_HINT}."
    return None


@functools.lru_cache(maxsize=4)
def _client(tracking_uri: str):
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    # a dashboard should say "cannot reach the store" in seconds, not retry for minutes
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri)


def _local_dir(uri: str) -> Path | None:
    if uri.startswith("file:"):
        return Path(unquote(urlparse(uri).path))
    return Path(uri) if "://" not in uri else None


def _checkpoint(run) -> Path | None:
    art = _local_dir(run.info.artifact_uri or "")
    candidates = [art / "drafter_best"] if art else []
    out_dir = run.data.params.get("train/out_dir")
    if out_dir:
        candidates.append(Path(out_dir) / "best")
    for c in candidates:
        if (c / "config.json").is_file() and (c / "model.safetensors").is_file():
            return c
    return None


def list_runs(tracking_uri: str | None, limit: int = 1000) -> tuple[list[RunInfo], str | None]:
    """All runs of the store, newest first, and a message when there are none (or the store can't be read)."""
    problem = store_problem(tracking_uri)
    if problem:
        return [], problem
    try:
        client = _client(tracking_uri)
        exps = {e.experiment_id: e.name for e in client.search_experiments()}
        runs = client.search_runs(list(exps), max_results=limit, order_by=["attributes.start_time DESC"])
    except Exception as e:   # a broken or unreachable store is shown, not raised: the other tabs still work
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return [], f"Cannot read the MLflow store `{tracking_uri}`: {first}"
    out = []
    for r in runs:
        m, tags, params = r.data.metrics, r.data.tags, r.data.params
        tau = m.get("val/best_tau", m.get("val/tau", m.get("best/tau")))
        out.append(RunInfo(run_id=r.info.run_id, name=r.info.run_name or r.info.run_id[:8],
                           experiment=exps.get(r.info.experiment_id, "?"), study=tags.get("optuna.study"),
                           parent_id=tags.get("mlflow.parentRunId"), is_sweep_parent=tags.get("sweep.parent") == "true",
                           method=params.get("drafter/method") or tags.get("method"), tau=tau,
                           start_time=r.info.start_time or 0, checkpoint=_checkpoint(r)))
    if not out:
        return [], f"The MLflow store `{tracking_uri}` has no runs yet: {FILL_HINT}."
    return out, None


def sweep_best_trials(runs: list[RunInfo], top: int = 3, latest_only: bool = True) -> list[RunInfo]:
    """The `top` trials by val τ of the latest sweep (or of every sweep), best first."""
    parents = sorted((r for r in runs if r.is_sweep_parent), key=lambda r: r.start_time, reverse=True)
    best = []
    for p in parents:
        trials = sorted((r for r in runs if r.parent_id == p.run_id and r.tau is not None),
                        key=lambda r: r.tau, reverse=True)
        if trials:
            best += trials[:top]
            if latest_only:
                break
    return best


def acceptance_rows(tracking_uri: str, run: RunInfo) -> list[dict]:
    """Per-position acceptance (P(accept position k | reached k)) at the validation with the best val τ."""
    client = _client(tracking_uri)
    hist = client.get_metric_history(run.run_id, "val/tau")
    best_step = max(hist, key=lambda h: h.value).step if hist else None
    keys = sorted(((int(mt.group(1)), k) for k in client.get_run(run.run_id).data.metrics
                   if (mt := ACCEPT_RE.match(k))))
    rows = []
    for pos, key in keys:
        h = client.get_metric_history(run.run_id, key)
        at = [x for x in h if x.step == best_step] or sorted(h, key=lambda x: x.step)[-1:]
        if at:
            rows.append({"run": run.label, "position": pos + 1, "acceptance": float(at[0].value)})
    return rows


def _shown_path(p: Path | None) -> str:
    if p is None:
        return ""
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


def runs_view(tracking_uri: str | None, selected: list[str] | None, best_of_latest_sweep: bool = False):
    """Everything the Runs tab shows: (message, choices [(label, run_id)], selected ids, table rows, curve rows)."""
    runs, problem = list_runs(tracking_uri)
    if problem:
        return problem, [], [], [], []
    by_id = {r.run_id: r for r in runs}
    choices = [(r.label, r.run_id) for r in runs if not r.is_sweep_parent]
    best = sweep_best_trials(runs)
    msg = f"{len(runs)} runs in `{tracking_uri}`."
    if best_of_latest_sweep:
        if not best:
            msg += " No sweep in this store yet (`python -m domino_lab.sweep`); showing the latest runs."
        selected = [r.run_id for r in best]
    selected = [s for s in (selected or []) if s in by_id]
    if not selected:
        selected = [r.run_id for r in best] or [r.run_id for r in runs if not r.is_sweep_parent][:4]
    table, curves = [], []
    for rid in selected:
        r = by_id[rid]
        table.append([r.label, r.experiment, r.study or "", r.method or "",
                      round(r.tau, 3) if r.tau is not None else None, _shown_path(r.checkpoint)])
        curves += acceptance_rows(tracking_uri, r)
    if selected and not curves:
        msg += " The selected runs logged no `val/accept_pos_{k}` yet."
    return msg, choices, selected, table, curves


def runs_figure(table: list[list], curves: list[dict]):
    """Per-position acceptance curves (left) and val τ (right) of the selected runs, or None when empty."""
    if not table:
        return None
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 3.8), layout="constrained")
    ax, bx = fig.subplots(1, 2, width_ratios=[2, 1])
    for label in dict.fromkeys(r["run"] for r in curves):
        pts = sorted((r["position"], r["acceptance"]) for r in curves if r["run"] == label)
        ax.plot([p for p, _ in pts], [a for _, a in pts], marker="o", label=label)
    ax.set(xlabel="draft position k", ylabel="P(accept k | reached k)", ylim=(0, 1.02),
           title="acceptance per draft position (at the best validation)")
    if curves:
        ax.legend(fontsize=7, loc="upper right")
    names = [row[0].split(" · ")[0] for row in table]
    taus = [row[4] or 0.0 for row in table]
    bx.barh(range(len(names)), taus, color=[f"C{i}" for i in range(len(names))])
    bx.set_yticks(range(len(names)), names, fontsize=7)
    bx.invert_yaxis()
    bx.set(xlabel="val τ (tokens per target call)", title="τ")
    return fig
