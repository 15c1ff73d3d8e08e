from .engine import speculative_generate
from .records import GenerationResult, StepRecord

__all__ = ["speculative_generate", "GenerationResult", "StepRecord"]
