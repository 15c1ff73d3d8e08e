"""Lightning callbacks of drafter training."""
from __future__ import annotations

from pathlib import Path

from lightning.pytorch.callbacks import Callback

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
