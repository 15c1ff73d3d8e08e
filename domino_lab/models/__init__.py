from .config import DrafterConfig
from .drafter import Draft, Drafter, load_drafter
from .options import InferenceOptions, add_inference_args
from . import registry

__all__ = ["DrafterConfig", "Draft", "Drafter", "InferenceOptions", "add_inference_args", "load_drafter", "registry"]
