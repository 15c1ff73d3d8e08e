"""`python -m domino_lab.sweep`: an Optuna study over the Domino head and curriculum; every trial is a
Lightning training run (the same `train()` as `python -m domino_lab.train`) scored by measured val/tau.

    python -m domino_lab.sweep                                  # experiments/sweeps/default.yaml, sqlite
    python -m domino_lab.sweep --n-trials 4 --storage postgresql://u:p@host/optuna   # one more worker

Re-running continues the study (same --study-name). MLflow: one parent run per study, one nested run per
trial. Plots and a summary land under <out_dir>/<study>/ and on the parent run.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from .errors import UserError, run_cli

DEFAULT_SWEEP = "experiments/sweeps/default.yaml"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m domino_lab.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=DEFAULT_SWEEP, help="sweep YAML (search space, budget, pruner)")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the sweep YAML (e.g. n_trials=2)")
    p.add_argument("--study-name")
    p.add_argument("--storage", help="Optuna RDB URL (default: sqlite under out_dir)")
    p.add_argument("--n-trials", type=int, help="trials for THIS worker (Optuna counts per worker)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: sqlite:///runs/mlflow.db)")
    p.add_argument("--timeout", type=float, help="stop starting new trials after this many minutes")
    p.add_argument("--runs-dir", help="where optuna.db, trial checkpoints, plots and the summary go (./runs/sweeps)")
    p.add_argument("--target", help="target for every trial (HF id, local dir, default)")
    p.add_argument("--seed", type=int, help="sampler seed and every trial's training seed")
    p.add_argument("--threads", type=int, help="torch threads for this worker (pin when workers share cores)")
    return p


def load_sweep_config(argv):
    from .config import load_config
    from .sweep_space import SweepConfig, validate_space

    args = build_parser().parse_intermixed_args(argv)
    overrides = list(args.overrides)
    if args.study_name:
        overrides.append(f"study_name={args.study_name}")
    if args.n_trials is not None:
        overrides.append(f"n_trials={args.n_trials}")
    if args.storage:
        overrides.append(f"storage={args.storage}")
    if args.tracking_uri:
        overrides.append(f"tracking_uri={args.tracking_uri}")
    for flag, key in (("timeout", "timeout_min"), ("runs_dir", "out_dir"), ("target", "target"), ("seed", "seed")):
        if getattr(args, flag) is not None:
            overrides.append(f"{key}={getattr(args, flag)}")
    cfg = load_config(SweepConfig, args.config, overrides)
    validate_space(cfg.space)
    if cfg.seed is not None:
        cfg.sampler = dict(cfg.sampler, seed=cfg.seed)
    # every swept name must be a real training option: check now, before any study or data is created
    probe = {name: (spec.get("value") if spec["type"] == "fixed" else
                    spec["choices"][0] if spec["type"] == "categorical" else spec["low"])
             for name, spec in cfg.space.items()}
    try:
        trial_config(cfg, probe, 0)
    except UserError as e:
        raise UserError(f"sweep {args.config}: {e}") from None
    if cfg.n_trials < 1:
        raise UserError("n_trials must be >= 1")
    bad = set(cfg.objectives) - {"tau", "draft_ms"}
    if bad or not cfg.objectives:
        raise UserError(f"objectives must be a non-empty subset of [tau, draft_ms], got {cfg.objectives}")
    return cfg, args.threads


def trial_config(sweep, params: dict, trial_number: int):
    """The TrainConfig of one trial: base recipe, sweep overrides, then the sampled values."""
    from .config import load_config
    from .training.config import TrainConfig

    out = Path(sweep.out_dir) / sweep.study_name / f"trial_{trial_number:04d}"
    ov = list(sweep.overrides) + [f"{k}={json.dumps(v)}" for k, v in params.items()]
    ov += [f"out_dir={out}", f"run_name=trial-{trial_number}", f"experiment={sweep.experiment}",
           "progress_bar=false"]     # the sweep prints its own progress; per-trial bars are noise
    if sweep.tracking_uri:
        ov.append(f"tracking_uri={sweep.tracking_uri}")
    if sweep.target:
        ov.append(f"target={sweep.target}")
    if sweep.seed is not None:
        ov.append(f"seed={sweep.seed}")
    return load_config(TrainConfig, sweep.base_config, ov)


def ensure_training_data(cfg, target, sweep) -> None:
    """A fresh clone has no regenerated data: create it with the target (resumable) before the first trial."""
    from .regenerate import load_meta, regenerate, training_prompts

    path = Path(cfg.data.path)
    if path.exists() and (path / "meta.json").exists():
        made_by = load_meta(path).get("weights_digest")
        if made_by in (None, target.weights_digest):
            return
        # e.g. the sweep's cache made by an older shipped target: keep it aside (never delete data) and regenerate
        aside = path.with_name(f"{path.name}.target-{made_by}")
        print(f"[sweep] {path} was made by another target; moved to {aside}, regenerating", file=sys.stderr)
        if aside.exists():
            shutil.rmtree(aside)
        path.rename(aside)

    print(f"[sweep] regenerating training data into {cfg.data.path} "
          f"({sweep.regen_math} math + {sweep.regen_code} code prompts)", file=sys.stderr)
    regenerate(target, training_prompts(sweep.regen_math, sweep.regen_code), cfg.data.path,
               max_new_tokens=sweep.regen_max_new_tokens, target_name=cfg.target)


def base_values(base_cfg, space: dict) -> dict:
    """The base recipe's own values for the swept parameters (enqueued as the baseline trial)."""
    out = {}
    for name, spec in space.items():
        node = base_cfg
        for part in name.split("."):
            node = getattr(node, part, None)
        if node is None or spec["type"] == "fixed":
            continue
        if spec["type"] == "categorical" and node not in spec["choices"]:
            continue
        if spec["type"] in ("int", "float") and not spec["low"] <= node <= spec["high"]:
            continue
        out[name] = node
    return out


def main(argv=None) -> int:
    sweep, threads = load_sweep_config(argv)
    import optuna
    import torch

    from .sweep_run import SweepRunner

    if threads:
        torch.set_num_threads(threads)
    import logging
    import warnings

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # one progress bar over trials; per-trial Lightning chatter would bury it
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", category=FutureWarning, module="optuna")
    runner = SweepRunner(sweep)
    summary = runner.run()
    print(summary["answer"])
    print(json.dumps({k: v for k, v in summary.items() if k != "answer"}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    run_cli(main)
