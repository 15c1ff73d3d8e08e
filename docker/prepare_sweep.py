"""`sweep-init` (docker-compose.yml): what every sweep worker would otherwise do on its first start, done once
before N workers start together on shared storage.

    python docker/prepare_sweep.py --config experiments/sweeps/default.yaml --storage postgresql+psycopg://... \
        --tracking-uri http://mlflow:5000

Same arguments as `python -m domino_lab.sweep`. It creates the study (and Optuna's tables) in the storage,
enqueues the baseline trial (the recipe's own values) once, and regenerates the sweep's training data with
the target into the shared runs/ volume, so that the workers neither race to create tables nor regenerate
the same data side by side. Running it again is harmless (everything is skipped when already there).
"""
from __future__ import annotations

import sys


def main(argv=None) -> int:
    import torch

    from domino_lab.sweep import base_values, ensure_training_data, load_sweep_config, trial_config
    from domino_lab.sweep_run import SweepRunner
    from domino_lab.target import Target

    sweep, threads = load_sweep_config(argv)
    if threads:
        torch.set_num_threads(threads)
    runner = SweepRunner(sweep)          # checks the MLflow tracking URI (and creates its tables if a database)
    base = trial_config(sweep, {}, 0)
    baseline = base_values(base, sweep.space)
    swept = [k for k, v in sweep.space.items() if v["type"] != "fixed"]
    with runner._setup_lock():
        study = runner._study()
        if sweep.enqueue_defaults and not study.trials and set(baseline) == set(swept):
            study.enqueue_trial(baseline, user_attrs={"baseline": True})
    target = Target.from_pretrained(base.target, dtype=base.dtype)
    ensure_training_data(base, target, sweep)
    print(f"study '{study.study_name}' ready in {runner.storage_url.split('@')[-1]} "
          f"({len(study.trials)} trial(s) so far); training data in {base.data.path}")
    return 0


if __name__ == "__main__":
    from domino_lab.errors import run_cli

    run_cli(main, sys.argv[1:])
