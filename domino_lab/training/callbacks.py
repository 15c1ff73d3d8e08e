"""Lightning callbacks of drafter training."""
from __future__ import annotations

from pathlib import Path

from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint, RichProgressBar
from lightning.pytorch.utilities.exceptions import SIGTERMException

KEPT = ("val/tau", "val/draft_ms", "val/verify_ms")


class ExportBest(Callback):
    """Export the drafter with the best val/tau seen so far (save_pretrained), surviving resume; keeps the
    validation numbers of that best point (τ, draft and verify ms per step) for the caller."""

    def __init__(self, path):
        self.path, self.best = Path(path), {}

    @property
    def best_tau(self):
        return self.best.get("val/tau")

    def on_validation_end(self, trainer, pl_module):
        tau = trainer.callback_metrics.get("val/tau")
        if tau is None or trainer.sanity_checking or not trainer.is_global_zero:
            return
        if self.best_tau is None or float(tau) > self.best_tau:
            self.best = {k: float(trainer.callback_metrics[k]) for k in KEPT if k in trainer.callback_metrics}
            pl_module.drafter.save_pretrained(self.path, provenance=pl_module.provenance())

    def state_dict(self):
        return {"best": self.best}

    def load_state_dict(self, state):
        self.best = state.get("best", {})


class BoundaryExceptionCheckpoint(OnExceptionCheckpoint):
    """`on_exception.ckpt` only where a run can be resumed exactly: a SIGTERM, which Lightning raises between steps,
    outside a validation and not at a step that validates. An error inside a step (an OOM in backward), a Ctrl-C, or a
    SIGTERM during or just before a validation would be saved mid-step or with that validation pending, and Lightning
    resumes such a state one step off or past the validation; those runs resume from the last periodic checkpoint
    (StepCheckpoint) instead, repeating the steps since."""

    def __init__(self, dirpath, validate_every: int):
        super().__init__(dirpath)
        self.validate_every = validate_every

    def on_exception(self, trainer, pl_module, exception):
        if (isinstance(exception, SIGTERMException) and not trainer.validating
                and trainer.global_step % self.validate_every):
            super().on_exception(trainer, pl_module, exception)


class StepCheckpoint(ModelCheckpoint):
    """A checkpoint every N optimiser steps; one whose step also validates is written after that validation.

    Lightning writes a step checkpoint in `on_train_batch_end`, before the validation the same step runs, and a run
    resumed from it treats that step, validation included, as done: the validation never happens, so ExportBest (whose
    state is in the checkpoint) never judges those weights, and `best/` could end up a later, worse drafter or
    missing. Written after the validation, the checkpoint holds its result, and Lightning, resuming from a save made
    at validation end, does not validate the step again."""

    def __init__(self, *args, validate_every: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.validate_every = validate_every
        self._deferred = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        n = self._every_n_train_steps
        if n and step % n == 0 and step % self.validate_every == 0 and not self._should_skip_saving_checkpoint(trainer):
            self._deferred = True         # this step validates: save once that has run
            return
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_validation_end(self, trainer, pl_module):
        super().on_validation_end(trainer, pl_module)
        if self._deferred and not trainer.sanity_checking:
            self._deferred = False
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)


class StepProgressBar(RichProgressBar):
    """Lightning's rich progress bar, for training that `max_steps` ends. With no epoch limit Lightning holds
    max_epochs = -1 and its bar reads "Epoch 0/-2" (max_epochs - 1); this one reads "Epoch 0" there and is otherwise
    Lightning's own."""

    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is not None and self.trainer.max_epochs < 0:
            # padded to the validation bar's label, as Lightning pads its own (the bars would flicker otherwise)
            return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"
        return super()._get_train_description(current_epoch)


def step_progress_bar() -> list:
    """[StepProgressBar()] where rich is installed (where Lightning would pick its rich bar), else [] (Lightning's
    tqdm bar, which names the epoch without a limit already)."""
    import importlib.util

    return [StepProgressBar()] if importlib.util.find_spec("rich") is not None else []
