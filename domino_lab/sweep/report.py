"""End-of-sweep report: a trials table, the answer (best vs the baseline trial), Optuna's plots."""
from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from pathlib import Path

import optuna
from mlflow.exceptions import MlflowException

from ..errors import atomic_path, mask_credentials


def _readable(path: Path) -> None:
    # atomic_path's temporary files are private (0600); a summary is for everyone the umask allows
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _json_safe(v):
    """`v` with every NaN or infinite float as None: JSON has no NaN (Python would write a bare NaN that strict
    readers, jq and browsers refuse), and a diverged trial's τ or loss can be one."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


def _fmt(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _plots(study, out: Path, space: dict, objectives: list[str]) -> list[Path]:
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
        jobs.append(("pareto_front", lambda: ovm.plot_pareto_front(study, target_names=list(objectives))))
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


def _pct(a: float, b: float) -> str:
    return f"{100 * (a / b - 1):+.1f}%" if b else "–"


def confirmation_lines(conf: dict | None, sweep) -> list[str]:
    """The confirmation stage as markdown: verdict, paired Δτ, per-seed τ, the noise band and the resolution."""
    if not conf:
        if sweep.confirm.seeds:
            return ["**Confirmation:** not run yet (it starts once the study has all its trials, with a complete "
                    "baseline and another complete trial).", ""]
        return ["**Confirmation:** off (confirm.seeds: 0). One seed and a short budget per trial: confirm a winner "
                "over several seeds before calling it (docs/design.md#sweep-resolution).", ""]
    b, base, res = conf["best"], conf["baseline"], conf["resolution"]
    lo, hi = conf["delta_ci"]
    lines = [f"**Confirmation: {conf['verdict']}.** Trial {b['trial']} against the baseline (trial {base['trial']}), "
             f"each trained with seeds {conf['seeds']} and scored on {conf['prompts']} held-out prompts × "
             f"{conf['max_new_tokens']} new tokens the search never scored: paired Δτ = {conf['delta_mean']:+.3f} "
             f"(95% CI {lo:+.3f} … {hi:+.3f}; {conf['n_pairs']} prompt×seed pairs, {conf['wins']} wins / "
             f"{conf['losses']} losses).", "",
             "| | trial | τ per seed | mean τ | speedup est. |", "|---|---|---|---|---|"]
    for name, side in (("best", b), ("baseline", base)):
        lines.append(f"| {name} | {side['trial']} | {' '.join(f'{t:.3f}' for t in side['tau_per_seed'])} | "
                     f"{side['tau_mean']:.3f} | " +
                     (f"{side['speedup_est']:.2f}x" if side.get("speedup_est") else "–") + " |")
    lines.append("")
    if res["noise_sd"] is not None and res["spread_sd"]:
        ok = "within" if res["resolved"] else "NOT within"
        lines.append(f"**Resolution:** seed noise of a trial score (SD of the baseline's τ over {len(conf['seeds'])} "
                     f"seeds) = {res['noise_sd']:.4f}; spread of the trial scores (SD over the complete trials, "
                     f"{res['spread_range'][0]:.3f} … {res['spread_range'][1]:.3f}) = {res['spread_sd']:.4f}; "
                     f"noise/spread = {res['noise_over_spread']:.2f}, {ok} the 1/3 the evaluation is sized for.")
        lines.append("")
    return lines


def write_report(study, sweep, out_dir: Path, client, parent: str, tracking_uri: str, storage_url: str,
                 max_steps: int | None = None, base_cfg=None) -> dict:
    plots_dir = out_dir / "plots"
    plots_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for t in study.trials:
        rows.append({"trial": t.number, "state": t.state.name, "values": t.values,
                     "last_intermediate": t.intermediate_values[max(t.intermediate_values)]
                     if t.intermediate_values else None,
                     "params": t.params, "baseline": bool(t.user_attrs.get("baseline")),
                     "speedup_est": t.user_attrs.get("speedup_est"), "draft_ms": t.user_attrs.get("draft_ms"),
                     "verify_ms": t.user_attrs.get("verify_ms"), "step_ms": t.user_attrs.get("step_ms"),
                     "seed": t.user_attrs.get("seed"),
                     "best_dir": t.user_attrs.get("best_dir"), "final_dir": t.user_attrs.get("final_dir"),
                     "mlflow_run_id": t.user_attrs.get("mlflow_run_id")})
    complete = [r for r in rows if r["state"] == "COMPLETE"]
    counts = {s: sum(r["state"] == s for r in rows) for s in ("COMPLETE", "PRUNED", "FAIL", "RUNNING")}
    multi = len(study.directions) > 1
    conf = study.user_attrs.get("confirmation")
    lines = []
    if not complete:
        answer = f"No trial of study '{sweep.study_name}' completed yet ({counts}); see {out_dir}."
    elif multi:
        front = study.best_trials
        unit = " ms" if sweep.objectives[1] == "draft_ms" else "× a plain step"
        answer = (f"Pareto front of τ vs draft latency ({len(front)} of {len(complete)} complete trials): " +
                  "; ".join(f"trial {t.number}: τ={t.values[0]:.3f}, draft {t.values[1]:.2f}{unit} "
                            f"({', '.join(f'{k}={_fmt(v)}' for k, v in t.params.items())})" for t in front))
    else:
        best = study.best_trial
        base = next((r for r in complete if r["baseline"]), None)
        answer = (f"Best of {len(rows)} trials ({counts['COMPLETE']} complete, {counts['PRUNED']} pruned, "
                  f"{counts['FAIL']} failed): trial {best.number}, val τ = {best.value:.3f} with " +
                  ", ".join(f"{k}={_fmt(v)}" for k, v in best.params.items()) + ".")
        if base is not None:
            answer += (f" The base recipe's own values (trial {base['trial']}) reach τ = {base['values'][0]:.3f}; "
                       f"the best is {_pct(best.value, base['values'][0])}.")
        if best.user_attrs.get("best_dir"):
            answer += f" Best drafter: {best.user_attrs['best_dir']}"
    if conf and complete:
        answer += (f"\nConfirmation ({len(conf['seeds'])} seeds × {conf['prompts']} held-out prompts): trial "
                   f"{conf['best']['trial']} vs the baseline, Δτ = {conf['delta_mean']:+.3f} (95% CI "
                   f"{conf['delta_ci'][0]:+.3f} … {conf['delta_ci'][1]:+.3f}): {conf['verdict']}.")
        res = conf["resolution"]
        if res["noise_over_spread"] is not None:
            answer += (f" Seed noise SD {res['noise_sd']:.4f} vs trial spread SD {res['spread_sd']:.4f} "
                       f"(ratio {res['noise_over_spread']:.2f}; sized for ≤ 0.33).")
    running = [r["trial"] for r in rows if r["state"] == "RUNNING"]
    if running:     # the study is not done while they run; say why, and what ends a dead worker's trial
        answer += (f"\n{'Trials' if len(running) > 1 else 'Trial'} {', '.join(map(str, running))} still RUNNING: "
                   f"another worker's, or a killed worker's, which the next run of the sweep fails and queues again "
                   f"once its heartbeat is {sweep.grace_period} s old (grace_period); the study is done"
                   + (", and its best trial confirmed," if sweep.confirm.seeds else "") + " after that.")
    lines.append(f"# Sweep `{sweep.study_name}`\n\n{answer}\n")
    if base_cfg is not None:
        e = base_cfg.eval
        how_trained = (f"head only (optim.train=head) on the backbone of `{base_cfg.drafter.init_from}`"
                       if base_cfg.optim.train == "head" else
                       f"the whole drafter{' from ' + repr(base_cfg.drafter.init_from) if base_cfg.drafter.init_from else ' from scratch'}")
        lines.append(f"Each trial trains {how_trained} for {base_cfg.max_steps} steps (batch {base_cfg.data.batch_size}, "
                     f"{base_cfg.data.features} target features) and is scored by τ of real greedy speculative "
                     f"decoding on {e.tau_prompts} held-out prompts × {e.tau_max_new_tokens} new tokens "
                     f"(validation split of {base_cfg.data.path}). Draft, verify and plain step ms: medians of 60 of each, "
                     "run in turn on a 128-token context after the trial (a draft after a target forward, as in a "
                     "decode; thread CPU time at one thread); speedup est. = τ × plain step ÷ (draft + verify), "
                     "from that trial's own measurement.\n")
    lines += confirmation_lines(conf, sweep)
    lines.append("| trial | state | " + " | ".join(sweep.objectives) + " | draft ms | verify ms | plain ms | speedup est. | params |")
    lines.append("|---|---|" + "---|" * len(sweep.objectives) + "---|---|---|---|---|")
    key = (lambda r: -(r["values"] or [float("-inf")])[0]) if not multi else (lambda r: r["trial"])
    for r in sorted(rows, key=lambda r: (r["state"] != "COMPLETE", key(r))):
        vals = r["values"] or [r["last_intermediate"]] + [None] * (len(sweep.objectives) - 1)
        lines.append(f"| {r['trial']}{' (baseline)' if r['baseline'] else ''} | {r['state']} | " +
                     " | ".join(_fmt(v) if v is not None else "–" for v in vals) + " | " +
                     " | ".join(f"{r[k]:.2f}" if r[k] is not None else "–" for k in ("draft_ms", "verify_ms", "step_ms")) +
                     " | " + (f"{r['speedup_est']:.2f}x" if r["speedup_est"] else "–") + " | " +
                     ", ".join(f"{k}={_fmt(v)}" for k, v in r["params"].items()) + " |")
    saved = pruning_savings(study, max_steps)
    counts["compute_saved_by_pruning"] = saved
    how = (f"Pruning saved {100 * saved:.0f}% of the trials' training steps. " if saved else "") + \
        f"Open the runs: mlflow ui --backend-store-uri {mask_credentials(tracking_uri)}  |  optuna-dashboard " \
        f"{mask_credentials(storage_url)}"
    plots = _plots(study, plots_dir, sweep.space, sweep.objectives)
    lines.append("\n" + how + "\n")
    lines.append("\n".join(f"![{p.stem}](plots/{p.name})" for p in plots))
    # summaries are replaced whole: several workers finishing together each write them, and a reader (the app,
    # a user's editor) never sees a half-written file
    with atomic_path(out_dir / "summary.md") as tmp:
        tmp.write_text("\n".join(lines) + "\n")
        _readable(tmp)
    conf_rows = set(confirmation_lines(conf, sweep))
    table = "\n".join(l for l in lines if l.startswith("|") and l not in conf_rows)
    conf_table = "\n".join(l for l in confirmation_lines(conf, sweep) if l.startswith("|"))
    summary = _json_safe({"study": sweep.study_name, "counts": counts, "confirmation": conf,
                          "confirmations": study.user_attrs.get("confirmations"), "trials": rows, "answer": answer,
                          "table": table, "confirmation_table": conf_table, "how": how,
                          "summary_md": str(out_dir / "summary.md"), "summary_json": str(out_dir / "summary.json"),
                          "plots": [str(p) for p in plots]})
    with atomic_path(out_dir / "summary.json") as tmp:
        tmp.write_text(json.dumps(summary, indent=2, default=str))
        _readable(tmp)
    client.log_artifact(parent, str(out_dir / "summary.md"))
    client.log_artifact(parent, str(out_dir / "summary.json"))
    for p in plots:
        client.log_artifact(parent, str(p), "plots")
    if complete and not multi:
        log_to_shared_run(client.log_metric, parent, "best/tau", study.best_value)
        log_to_shared_run(client.set_tag, parent, "best_trial", str(study.best_trial.number))
    return summary


def log_to_shared_run(log, run_id: str, key: str, value, attempts: int = 3) -> bool:
    """Log a tag or metric on the study's parent run, which every worker that finishes writes to. MLflow's SQL
    store writes a tag as read-then-insert, so two workers finishing together can both insert ("duplicate key
    value violates unique constraint tag_pk" on PostgreSQL); after the loser's failure the row exists and
    trying again updates it. The study holds the result and the tracking store only mirrors it, so a write that
    keeps failing is reported, not raised."""
    for i in range(attempts):
        try:
            log(run_id, key, value)
            return True
        except MlflowException as e:
            if i == attempts - 1:
                print(f"[sweep] could not log {key} on the parent run: {str(e).splitlines()[0]}", file=sys.stderr)
                return False
            time.sleep(0.05 * (i + 1))
    return False
