"""Lightning callbacks of drafter training."""
from __future__ import annotations

from pathlib import Path

from lightning.pytorch.callbacks import Callback


class ExportBest(Callback):
    """Export the drafter with the best val/tau seen so far (save_pretrained), surviving resume."""

    def __init__(self, path):
        self.path, self.best_tau, self.best_draft_ms = Path(path), None, None

    def on_validation_end(self, trainer, pl_module):
        tau = trainer.callback_metrics.get("val/tau")
        if tau is None or trainer.sanity_checking or not trainer.is_global_zero:
            return
        tau = float(tau)
        if self.best_tau is None or tau > self.best_tau:
            self.best_tau = tau
            ms = trainer.callback_metrics.get("val/draft_ms")
            self.best_draft_ms = float(ms) if ms is not None else None
            pl_module.drafter.save_pretrained(self.path)

    def state_dict(self):
        return {"best_tau": self.best_tau, "best_draft_ms": self.best_draft_ms}

    def load_state_dict(self, state):
        self.best_tau = state.get("best_tau")
        self.best_draft_ms = state.get("best_draft_ms")
