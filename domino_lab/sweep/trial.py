"""Pieces of a sweep trial shared by the search and the confirmation stage (sweep/runner.py, sweep/confirm.py):
whether a study can be confirmed, what a trial's drafter costs per step, and the progress bar inside a trial."""
from __future__ import annotations

import sys

import lightning.pytorch as pl
import optuna


def confirmable(study) -> bool:
    """A confirmation can run: a complete baseline trial and at least one other complete trial."""
    done = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]
    return any(t.user_attrs.get("baseline") for t in done) and any(not t.user_attrs.get("baseline") for t in done)


def drafter_costs(target, drafter) -> dict:
    """Draft, verify and plain step ms of a trial's drafter (a Drafter or its directory) on `target`, measured
    decode-like on the side (domino_lab/experiments/timing.py, step_costs)."""
    from ..experiments.timing import step_costs
    from ..models import Drafter

    if not isinstance(drafter, Drafter):
        drafter = Drafter.from_pretrained(drafter, target)
    return step_costs(target, drafter.eval(), reps=20)


class TrialProgress(pl.Callback):
    """A progress bar inside a trial (stderr): optimiser steps, the running loss, the last val τ. Lightning's
    own bar is off in sweeps (it would print a line per validation); this one is one line per trial."""

    def __init__(self, label: str, total: int):
        self.label, self.total, self.bar, self.tau = label, total, None, None

    def on_train_start(self, trainer, pl_module):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=self.total, desc=self.label, unit="step", file=sys.stderr, leave=False,
                        dynamic_ncols=True, initial=trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.bar is None:
            return
        self.bar.update(trainer.global_step - self.bar.n)
        loss = trainer.callback_metrics.get("train/loss")
        post = {"loss": f"{float(loss):.3f}"} if loss is not None else {}
        if self.tau is not None:
            post["val τ"] = f"{self.tau:.3f}"
        self.bar.set_postfix(post, refresh=False)

    def on_validation_start(self, trainer, pl_module):
        if self.bar is not None:
            self.bar.set_postfix_str("measuring val τ …")

    def on_validation_end(self, trainer, pl_module):
        tau = trainer.callback_metrics.get("val/tau")
        if tau is not None and self.bar is not None:
            self.tau = float(tau)
            self.bar.set_postfix({"val τ": f"{self.tau:.3f}"})

    def on_exception(self, trainer, pl_module, exception):
        # (Lightning skips teardown on an exception: the bar would be cleared at exit, after the error line)
        self.teardown(trainer, pl_module, None)

    def teardown(self, trainer, pl_module, stage):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
