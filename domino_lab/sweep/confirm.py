"""The confirmation stage of a sweep: is the winner real?

A search ranks trials by one seed each on one prompt set, so its best trial is partly the luckiest one. After the
search, the best trial(s) and the baseline (trial 0, the recipe's own values) are trained again with
`confirm.seeds` more seeds and every model (the trial's own seed included) is scored on held-out prompts the
search never saw (the validation split after the search's `eval.tau_prompts`). The comparison is paired, prompt by
prompt and seed by seed: Δτ = τ_best − τ_baseline with a 95% CI pooled over seeds
(`domino_lab.experiments.report.pooled_pair`, the same statistic the experiment reports use), and the verdict is
"confirmed" (CI above 0), "worse" (CI below 0) or "not distinguishable from the baseline".

The same runs measure the resolution of a trial's score: the standard deviation of the baseline's τ over seeds
(its seed noise, on as many prompts as a trial is scored on) against the spread (standard deviation) of the
trials' scores. A search resolves its trials when the noise is at most a third of the spread.

Every finished model's result is kept in the study (user attribute `confirm:<trial>:<seed>`), so a killed worker's
re-run continues where it stopped; one worker at a time runs the stage (`confirm_owner`).
"""
from __future__ import annotations

import os
import shutil
import socket
import statistics
import sys
from pathlib import Path

import optuna

from .report import log_to_shared_run

VERDICTS = ("confirmed", "not distinguishable from the baseline", "worse")
RESOLUTION_RATIO = 1 / 3     # the seed noise a trial score may have, as a share of the spread between trials


def verdict(ci: list[float]) -> str:
    lo, hi = ci
    return VERDICTS[0] if lo > 0 else VERDICTS[2] if hi < 0 else VERDICTS[1]


def resolution(trial_scores: list[float], baseline_taus: list[float]) -> dict:
    """Seed noise of a trial's score (SD of the baseline's τ over its seeds) against the spread of the trial
    scores (their SD): `resolved` when the noise is at most RESOLUTION_RATIO of the spread."""
    noise = statistics.stdev(baseline_taus) if len(baseline_taus) > 1 else None
    spread = statistics.stdev(trial_scores) if len(trial_scores) > 1 else None
    ratio = noise / spread if noise is not None and spread else None
    return {"noise_sd": noise, "spread_sd": spread, "noise_over_spread": ratio,
            "resolved": ratio is not None and ratio <= RESOLUTION_RATIO,
            "spread_range": [min(trial_scores), max(trial_scores)] if trial_scores else None}


def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _alive(owner: str) -> bool:
    """Whether the worker that claimed the stage may still be running (another host's worker: assume so)."""
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname():
        return True
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def _claim(runner) -> bool:
    with runner._setup_lock():
        study = runner._reload_study()
        owner = study.user_attrs.get("confirm_owner")
        if owner and owner != _owner() and _alive(owner):
            return False
        study.set_user_attr("confirm_owner", _owner())
    return True


def _model_dir(trial) -> str | None:
    final = trial.user_attrs.get("final_dir")
    if final:
        return final
    best = trial.user_attrs.get("best_dir")      # studies from before final_dir was recorded
    return str(Path(best).parent / "final") if best else None


def _train_seed(runner, trial, seed: int, role: str) -> tuple[str, str]:
    """Train the trial's configuration with another seed; (its final drafter's folder, its MLflow run id)."""
    from lightning.pytorch.loggers import MLFlowLogger
    from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

    from ..train import train
    from .config import trial_config
    from ..training.tracking import end_run
    from .trial import TrialProgress

    sweep = runner.sweep
    out = runner.dir / "confirm" / f"trial_{trial.number:04d}" / f"seed_{seed}"
    if out.exists():      # a run killed before its result was recorded: start it again
        shutil.rmtree(out)
    # the comparison's own held-out prompts score the model, so the search's validation τ is skipped here
    cfg = trial_config(sweep, dict(trial.params), trial.number, seed=seed, out_dir=out,
                       extra=["eval.tau_prompts=0", f"run_name=confirm-trial-{trial.number}-seed-{seed}"])
    cfg.tracking_uri = runner.tracking_uri
    logger = MLFlowLogger(experiment_name=sweep.experiment, run_name=cfg.run_name, tracking_uri=runner.tracking_uri,
                          tags={MLFLOW_PARENT_RUN_ID: runner.parent, "optuna.study": sweep.study_name,
                                "optuna.trial": str(trial.number), "sweep.stage": "confirmation",
                                "confirm.role": role, "confirm.seed": str(seed)})
    logger.log_hyperparams({f"trial.{k}": v for k, v in trial.params.items()})
    try:
        res = train(cfg, extra_callbacks=[TrialProgress(f"confirm {role} (trial {trial.number}) seed {seed}",
                                                        cfg.max_steps)],
                    logger=logger, target=runner.target)
    except BaseException as e:      # the MLflow run must not stay RUNNING (the re-run trains this seed again)
        end_run(logger.experiment, logger.run_id, "FAILED" if isinstance(e, Exception) else "KILLED")
        raise
    return res["final_dir"], logger.run_id


def _score(runner, trial, seed: int, role: str) -> dict:
    """One (configuration, seed) scored on the confirmation prompts; recorded in the study."""
    from ..models import Drafter
    from ..training.module import measure_tau
    from .trial import drafter_costs

    key = f"confirm:{trial.number}:{seed}"
    done = runner._reload_study().user_attrs.get(key)
    if done and len(done["per_prompt"]) == len(runner.confirm_prompts):
        return done
    if done and Path(done["dir"]).is_dir():     # scored on another confirm.prompts: the model is scored again
        path, run_id = done["dir"], done["run_id"]
    elif seed == trial.user_attrs.get("seed", runner.base.seed) and _model_dir(trial):
        path, run_id = _model_dir(trial), trial.user_attrs.get("mlflow_run_id")
    else:
        path, run_id = _train_seed(runner, trial, seed, role)
    print(f"[sweep] confirm: τ of trial {trial.number} ({role}), seed {seed}, on {len(runner.confirm_prompts)} "
          "held-out prompts", file=sys.stderr, flush=True)
    drafter = Drafter.from_pretrained(path, runner.target)
    ev = runner.base.eval
    stats = measure_tau(runner.target, drafter, runner.confirm_prompts, ev.tau_max_new_tokens, batch=ev.tau_batch)
    costs = drafter_costs(runner.target, drafter)
    out = {"tau": stats["tau"], "per_prompt": stats["per_prompt"], "draft_ms": costs["draft_ms"],
           "verify_ms": costs["verify_ms"], "step_ms": costs["step_ms"], "dir": path, "run_id": run_id}
    if run_id:
        runner.client.log_metric(run_id, "confirm/tau", stats["tau"])
        runner.client.set_tag(run_id, "confirm.role", role)
    runner.study.set_user_attr(key, out)
    return out


def _side(trial, scores: dict, runner) -> dict:
    taus = [scores[s]["tau"] for s in sorted(scores, key=int)]
    from ..decoding.metrics import speedup_bound

    speed = [speedup_bound(r["tau"], r["step_ms"], r["draft_ms"], r["verify_ms"]) for r in scores.values()
             if r.get("step_ms")]
    return {"trial": trial.number, "params": dict(trial.params), "search_tau": trial.values[0],
            "tau_per_seed": taus, "tau_mean": statistics.fmean(taus),
            "tau_sd": statistics.stdev(taus) if len(taus) > 1 else None,
            "speedup_est": statistics.fmean(speed) if speed else None,
            "mlflow_run_ids": [scores[s]["run_id"] for s in sorted(scores, key=int)]}


def run_confirmation(runner, study) -> dict | None:
    """Run (or finish) the stage for `study` and record its result as the study's `confirmation` user attribute
    (plus `confirmations`, one per confirmed trial when confirm.top > 1). None when there is nothing to confirm
    or another live worker is running it."""
    from ..experiments.report import pooled_pair
    from .trial import confirmable

    c = runner.sweep.confirm
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    if not confirmable(study):
        print("[sweep] confirmation skipped: it needs the complete baseline trial and another complete trial",
              file=sys.stderr)
        return None
    baseline = next(t for t in complete if t.user_attrs.get("baseline"))
    best = sorted((t for t in complete if not t.user_attrs.get("baseline")), key=lambda t: -t.values[0])[:c.top]
    seed0 = baseline.user_attrs.get("seed", runner.base.seed)
    seeds = [seed0 + k for k in range(c.seeds + 1)]
    prior = study.user_attrs.get("confirmations")
    if prior and [(x["best"]["trial"], x["seeds"], x["prompts"]) for x in prior] == \
            [(t.number, seeds, len(runner.confirm_prompts)) for t in best]:
        return prior[0]          # done for these trials already (a re-run of a finished study)
    # otherwise (other trials, or another confirm.seeds or confirm.prompts) the stage runs again: every model
    # already scored on these prompts is taken from the study, only the missing ones are trained or scored
    if not _claim(runner):
        print("[sweep] the confirmation stage is running in another worker", file=sys.stderr)
        return None
    scores = {t.number: {str(s): _score(runner, t, s, "baseline" if t is baseline else "best") for s in seeds}
              for t in [baseline] + best}
    trial_scores = [t.values[0] for t in complete]
    res = resolution(trial_scores, [scores[baseline.number][str(s)]["tau"] for s in seeds])
    out = []
    for t in best:
        pr = pooled_pair({"best": scores[t.number], "baseline": scores[baseline.number]}, "best", "baseline")
        out.append({"seeds": seeds, "prompts": len(runner.confirm_prompts),
                    "max_new_tokens": runner.base.eval.tau_max_new_tokens,
                    "delta_mean": pr["mean_diff"], "delta_ci": pr["ci95"], "n_pairs": pr["n"],
                    "wins": pr["wins"], "losses": pr["losses"], "verdict": verdict(pr["ci95"]),
                    "best": _side(t, scores[t.number], runner),
                    "baseline": _side(baseline, scores[baseline.number], runner), "resolution": res})
    study.set_user_attr("confirmations", out)
    study.set_user_attr("confirmation", out[0])
    first = out[0]
    metrics = [("confirm/delta_tau", first["delta_mean"]), ("confirm/delta_ci_lo", first["delta_ci"][0]),
               ("confirm/delta_ci_hi", first["delta_ci"][1]), ("confirm/best_tau", first["best"]["tau_mean"]),
               ("confirm/baseline_tau", first["baseline"]["tau_mean"])]
    if res["noise_sd"] is not None:
        metrics.append(("confirm/noise_sd", res["noise_sd"]))
    for k, v in metrics:
        log_to_shared_run(runner.client.log_metric, runner.parent, k, v)
    log_to_shared_run(runner.client.set_tag, runner.parent, "confirm.verdict", first["verdict"])
    log_to_shared_run(runner.client.set_tag, runner.parent, "confirm.best_trial", str(first["best"]["trial"]))
    return first
