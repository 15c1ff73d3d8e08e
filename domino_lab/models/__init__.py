from .config import DrafterConfig
from .drafter import Drafter, load_drafter

__all__ = ["DrafterConfig", "Drafter", "load_drafter"]
