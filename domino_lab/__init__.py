"""domino-lab: train, sweep, compare and watch Domino / DFlash speculative-decoding drafters.

`from domino_lab import Target, Drafter, DrafterConfig, speculative_generate` — imported lazily, so
`python -m domino_lab.<cli> --help` and bad-argument errors answer without loading torch/transformers.
"""
import os

# Several torch processes often share 2 cores here (sweep workers, DDP ranks, a background job); spinning
# OpenMP threads of oversubscribed processes were measured 7x slower than passive ones. Users can override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
__all__ = ["Target", "Drafter", "DrafterConfig", "InferenceOptions", "speculative_generate", "StepRecord",
           "GenerationResult"]

_LAZY = {"Target": ".target", "Drafter": ".models", "DrafterConfig": ".models", "InferenceOptions": ".models",
         "speculative_generate": ".decoding", "StepRecord": ".decoding", "GenerationResult": ".decoding"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'domino_lab' has no attribute {name!r}")
