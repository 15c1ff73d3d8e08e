"""`python -m domino_lab.sweep`: an Optuna study over the Domino head and curriculum; every trial is a
Lightning training run (the same `train()` as `python -m domino_lab.train`) scored by measured val/tau.

    python -m domino_lab.sweep                                  # experiments/sweeps/default.yaml, sqlite
    python -m domino_lab.sweep --n-trials 4 --storage postgresql://u:p@host/optuna   # one more worker
    python -m domino_lab.sweep --prepare-only --storage ...     # study, baseline, MLflow run and data; no trial

Re-running continues the study (same --study-name). MLflow: one parent run per study, one nested run per
trial. Everything the sweep writes goes under --runs-dir (default <repository>/runs: optuna.db, trials,
plots and the summary in runs/sweeps, the MLflow store in runs/mlflow.db, training data in runs/regenerated).
"""
from __future__ import annotations

import argparse
import json

from ..errors import CliParser, UserError, run_cli, sigterm_stops
from ..validation import check_threads
from .config import DEFAULT_SWEEP, load_sweep


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(prog="python -m domino_lab.sweep", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=DEFAULT_SWEEP, help="sweep YAML (search space, budget, pruner)")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the sweep YAML (e.g. n_trials=2)")
    p.add_argument("--study-name")
    p.add_argument("--storage", help="Optuna RDB URL (default: sqlite under the runs folder)")
    p.add_argument("--n-trials", type=int, help="trials for THIS worker (Optuna counts per worker)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: sqlite:///<runs folder>/mlflow.db)")
    p.add_argument("--timeout", type=float, help="stop starting new trials after this many minutes (> 0; sets the "
                                                 "sweep's timeout_min; default: no limit)")
    p.add_argument("--runs-dir", help="one folder for everything the sweep writes: optuna.db, trial checkpoints, "
                                      "plots, the summary, the MLflow store and artifacts, the training data "
                                      "(default: <repository>/runs, the sweep itself in runs/sweeps)")
    p.add_argument("--target", help="target for every trial (HF id, local dir, default)")
    p.add_argument("--init-from", help="drafter whose backbone every trial starts from (shipped name such as "
                                       "default-dflash, or a drafter directory); sets drafter.init_from")
    p.add_argument("--json", action="store_true", help="print summary.json's content instead of the readable report")
    p.add_argument("--seed", type=int, help="sampler seed and every trial's training seed")
    p.add_argument("--threads", type=int, help="torch threads for this worker, >= 1 (pin when workers share cores; "
                                               "default: torch's own count)")
    p.add_argument("--prepare-only", action="store_true",
                   help="create the study, its baseline trial, the MLflow parent run and the training data, then "
                        "exit (once, before N workers start together on shared storage)")
    p.add_argument("--claim-gpu", action="store_true",
                   help="with PostgreSQL storage and several GPUs: take a GPU no other worker holds "
                        "(CUDA_VISIBLE_DEVICES), waiting for one if all are taken; no-op otherwise")
    return p


def parse_args(argv=None):
    """(SweepConfig, parsed arguments) of a command line."""
    args = build_parser().parse_intermixed_args(argv)
    if args.threads is not None:        # checked with the rest, before any study or data exists
        check_threads(args.threads)
    if args.study_name is not None and not args.study_name.strip():
        raise UserError("--study-name is empty; name the study (or leave the flag out for the sweep YAML's name)")
    overrides = list(args.overrides)
    for flag, key in (("study_name", "study_name"), ("n_trials", "n_trials"), ("storage", "storage"),
                      ("tracking_uri", "tracking_uri"), ("timeout", "timeout_min"), ("target", "target"),
                      ("seed", "seed")):
        value = getattr(args, flag)
        if value is not None:
            # names and URLs as JSON strings: an override's value is read as YAML, where "ablation #2" would
            # lose its comment and "0042" become a number
            overrides.append(f"{key}={json.dumps(value) if isinstance(value, str) else value}")
    sweep = load_sweep(args.config, overrides, runs_dir=args.runs_dir)
    if args.init_from is not None:
        # a trial override, after the sweep's own (the last value of a key wins); checked like the YAML's
        overrides.append("overrides=" + json.dumps(sweep.overrides + [f"drafter.init_from={json.dumps(args.init_from)}"]))
        sweep = load_sweep(args.config, overrides, runs_dir=args.runs_dir)
    return sweep, args


def _quiet() -> None:
    """The sweep's own progress (a bar inside each trial, a line per finished trial); per-trial Lightning chatter
    and Optuna's notices would bury it."""
    import logging
    import warnings

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", category=FutureWarning, module="optuna")


def main(argv=None) -> int:
    sweep, args = parse_args(argv)
    gpu_claim = None
    if args.claim_gpu:       # before anything starts CUDA
        from .gpu import claim_for_worker

        gpu_claim = claim_for_worker(sweep.storage)
    try:
        import torch

        if args.threads is not None:
            torch.set_num_threads(args.threads)
        _quiet()
        from .runner import prepare, run_worker

        runner = prepare(sweep)
        if args.prepare_only:
            where = runner.storage_url.split("@")[-1]
            print(f"study '{sweep.study_name}' ready in {where} ({len(runner.study.trials)} trial(s) so far); "
                  f"training data in {runner.base.data.path}")
            return 0
        # (the runner has queued the interrupted trial again)
        with sigterm_stops("sweep", "run the same command again to continue the study"):
            summary = run_worker(sweep, runner)
    finally:
        if gpu_claim is not None:
            gpu_claim.close()        # frees the GPU for the next worker
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
        return 0
    # a person reads the answer, the table and where to look; every trial's record is in summary.json (--json)
    print(summary["answer"])
    print()
    if summary["confirmation_table"]:
        print(summary["confirmation_table"])
        print()
    print(summary["table"])
    print()
    print(f"Report: {summary['summary_md']} (plots beside it; every trial's record: {summary['summary_json']})")
    print(summary["how"])
    return 0


if __name__ == "__main__":
    run_cli(main)
