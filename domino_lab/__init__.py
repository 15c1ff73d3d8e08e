"""domino-lab: train, sweep, compare and watch Domino / DFlash speculative-decoding drafters."""
from .decoding import GenerationResult, StepRecord, speculative_generate
from .models import Drafter, DrafterConfig
from .target import Target

__version__ = "0.1.0"
__all__ = ["Target", "Drafter", "DrafterConfig", "speculative_generate", "StepRecord", "GenerationResult"]
