"""End-of-sweep report: a trials table, the answer (best vs the baseline trial), Optuna's plots."""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import optuna

from ..errors import atomic_path, mask_credentials


def _readable(path: Path) -> None:
    # atomic_path's temporary files are private (0600); a summary is for everyone the umask allows
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _fmt(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _plots(study, out: Path, space: dict) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as ovm

    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    target = (lambda t: t.values[0]) if len(study.directions) > 1 else None
    name = "tau"
    made = []
    jobs = [("optimization_history", lambda: ovm.plot_optimization_history(study, target=target, target_name=name)),
            ("slice", lambda: ovm.plot_slice(study, target=target, target_name=name))]
    if len(done) >= 2:
        jobs.append(("param_importances", lambda: ovm.plot_param_importances(study, target=target, target_name=name)))
    if {"drafter.rank", "drafter.gru_hidden"} <= set(space) and len(done) >= 2:
        jobs.append(("contour_rank_gru", lambda: ovm.plot_contour(
            study, params=["drafter.rank", "drafter.gru_hidden"], target=target, target_name=name)))
    if len(study.directions) > 1 and done:
        jobs.append(("pareto_front", lambda: ovm.plot_pareto_front(study, target_names=["tau", "draft_ms"])))
    for fname, make in jobs:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")      # Optuna's "experimental" warnings
                ax = make()
            fig = (ax.flat[0] if hasattr(ax, "flat") else ax).get_figure()
            fig.set_size_inches(max(6, fig.get_size_inches()[0]), 4.5)
            path = out / f"{fname}.png"
            with atomic_path(path, suffix=".png") as tmp:     # a reader never sees half a picture
                fig.savefig(tmp, dpi=100, bbox_inches="tight")
                _readable(tmp)
            plt.close(fig)
            made.append(path)
        except (ValueError, RuntimeError, ZeroDivisionError) as e:   # e.g. too few trials for importances
            with atomic_path(out / f"{fname}.skipped.txt") as tmp:
                tmp.write_text(f"{type(e).__name__}: {e}\n")
    return made


def pruning_savings(study, max_steps: int) -> float | None:
    """Share of training steps that pruning saved: 1 − steps run / steps all finished trials would have run."""
    done = [t for t in study.trials if t.state.name in ("COMPLETE", "PRUNED")]
    if not done or not max_steps:
        return None
    ran = sum(max_steps if t.state.name == "COMPLETE" else max(t.intermediate_values or [0]) for t in done)
    return 1 - ran / (max_steps * len(done))


def write_report(study, sweep, out_dir: Path, client, parent: str, tracking_uri: str, storage_url: str,
                 max_steps: int | None = None) -> dict:
    plots_dir = out_dir / "plots"
    plots_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for t in study.trials:
        rows.append({"trial": t.number, "state": t.state.name, "values": t.values,
                     "last_intermediate": t.intermediate_values[max(t.intermediate_values)]
                     if t.intermediate_values else None,
                     "params": t.params, "baseline": bool(t.user_attrs.get("baseline")),
                     "speedup_est": t.user_attrs.get("speedup_est"),
                     "best_dir": t.user_attrs.get("best_dir"), "mlflow_run_id": t.user_attrs.get("mlflow_run_id")})
    complete = [r for r in rows if r["state"] == "COMPLETE"]
    counts = {s: sum(r["state"] == s for r in rows) for s in ("COMPLETE", "PRUNED", "FAIL", "RUNNING")}
    multi = len(study.directions) > 1
    lines = []
    if not complete:
        answer = f"No trial of study '{sweep.study_name}' completed yet ({counts}); see {out_dir}."
    elif multi:
        front = study.best_trials
        answer = (f"Pareto front of τ vs draft latency ({len(front)} of {len(complete)} complete trials): " +
                  "; ".join(f"trial {t.number}: τ={t.values[0]:.3f}, draft {t.values[1]:.2f} ms "
                            f"({', '.join(f'{k}={_fmt(v)}' for k, v in t.params.items())})" for t in front))
    else:
        best = study.best_trial
        base = next((r for r in complete if r["baseline"]), None)
        answer = (f"Best of {len(rows)} trials ({counts['COMPLETE']} complete, {counts['PRUNED']} pruned, "
                  f"{counts['FAIL']} failed): trial {best.number}, val τ = {best.value:.3f} with " +
                  ", ".join(f"{k}={_fmt(v)}" for k, v in best.params.items()) + ".")
        if base is not None:
            gain = 100 * (best.value / base["values"][0] - 1)
            answer += (f" The base recipe's own values (trial {base['trial']}) reach τ = {base['values'][0]:.3f}; "
                       f"the best is {gain:+.1f}%.")
        answer += (" One seed and a short budget per trial: confirm a winner over several seeds before "
                   "calling it (docs/design.md#laptop-scale-evidence).")
        if best.user_attrs.get("best_dir"):
            answer += f" Best drafter: {best.user_attrs['best_dir']}"
    lines.append(f"# Sweep `{sweep.study_name}`\n\n{answer}\n")
    lines.append("| trial | state | " + " | ".join(sweep.objectives) + " | speedup est. | params |")
    lines.append("|---|---|" + "---|" * len(sweep.objectives) + "---|---|")
    key = (lambda r: -(r["values"] or [float("-inf")])[0]) if not multi else (lambda r: r["trial"])
    for r in sorted(rows, key=lambda r: (r["state"] != "COMPLETE", key(r))):
        vals = r["values"] or [r["last_intermediate"]] + [None] * (len(sweep.objectives) - 1)
        lines.append(f"| {r['trial']}{' (baseline)' if r['baseline'] else ''} | {r['state']} | " +
                     " | ".join(_fmt(v) if v is not None else "–" for v in vals) + " | " +
                     (f"{r['speedup_est']:.2f}x" if r["speedup_est"] else "–") + " | " +
                     ", ".join(f"{k}={_fmt(v)}" for k, v in r["params"].items()) + " |")
    saved = pruning_savings(study, max_steps)
    counts["compute_saved_by_pruning"] = saved
    how = (f"Pruning saved {100 * saved:.0f}% of the trials' training steps. " if saved is not None else "") + \
        f"Open the runs: mlflow ui --backend-store-uri {mask_credentials(tracking_uri)}  |  optuna-dashboard " \
        f"{mask_credentials(storage_url)}"
    plots = _plots(study, plots_dir, sweep.space)
    lines.append("\n" + how + "\n")
    lines.append("\n".join(f"![{p.stem}](plots/{p.name})" for p in plots))
    # summaries are replaced whole: several workers finishing together each write them, and a reader (the app,
    # a user's editor) never sees a half-written file
    with atomic_path(out_dir / "summary.md") as tmp:
        tmp.write_text("\n".join(lines) + "\n")
        _readable(tmp)
    answer = answer + "\n" + "\n".join(l for l in lines[1:] if l.startswith("|")) + "\n" + how
    summary = {"study": sweep.study_name, "counts": counts, "trials": rows, "answer": answer,
               "summary_md": str(out_dir / "summary.md"), "plots": [str(p) for p in plots]}
    with atomic_path(out_dir / "summary.json") as tmp:
        tmp.write_text(json.dumps(summary, indent=2, default=str))
        _readable(tmp)
    client.log_artifact(parent, str(out_dir / "summary.md"))
    for p in plots:
        client.log_artifact(parent, str(p), "plots")
    if complete and not multi:
        client.log_metric(parent, "best/tau", study.best_value)
        client.set_tag(parent, "best_trial", str(study.best_trial.number))
    return summary
