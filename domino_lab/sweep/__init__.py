"""The Optuna sweep over the Domino head and its curriculum: every trial is a Lightning training run (the same
`train()` as `python -m domino_lab.train`) scored by measured val/tau.

    config.py   SweepConfig (the sweep YAML), `load_sweep`, `trial_config` (a trial's TrainConfig)
    space.py    the search space: validation, suggest_* calls, samplers and pruners
    runner.py   `prepare(sweep)` (storage, study, baseline trial, MLflow parent run, training data) and
                `run_worker(sweep)` (trials until the budget is spent, then the report)
    report.py   the end-of-sweep summary and plots
    gpu.py      one GPU per worker when several workers share a host (`--claim-gpu`)
    __main__.py `python -m domino_lab.sweep`

Importing this package is cheap; `prepare` and `run_worker` load Optuna, MLflow and Lightning when called.
"""
from .config import DEFAULT_SWEEP, SweepConfig, base_values, load_sweep, trial_config

__all__ = ["DEFAULT_SWEEP", "SweepConfig", "base_values", "load_sweep", "trial_config", "prepare", "run_worker"]


def prepare(sweep, target=None):
    """See `domino_lab.sweep.runner.prepare`."""
    from .runner import prepare as _prepare

    return _prepare(sweep, target=target)


def run_worker(sweep, runner=None) -> dict:
    """See `domino_lab.sweep.runner.run_worker`."""
    from .runner import run_worker as _run_worker

    return _run_worker(sweep, runner=runner)
