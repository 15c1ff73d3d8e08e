"""The drafters. Their names are imported lazily (like the package's), so a CLI can read `models.options` — its
flags and their checks — without loading torch."""
_LAZY = {"DrafterConfig": ".config", "Draft": ".drafter", "Drafter": ".drafter", "load_drafter": ".drafter",
         "InferenceOptions": ".options", "add_inference_args": ".options"}

__all__ = ["DrafterConfig", "Draft", "Drafter", "InferenceOptions", "add_inference_args", "load_drafter", "registry"]


def __getattr__(name):
    import importlib

    if name == "registry":
        return importlib.import_module(".registry", __name__)
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
