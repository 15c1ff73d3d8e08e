"""Drafter families by method name.

Each family is one `Drafter` subclass in its own module of this package, registered with `@register(name, ...)`:
it owns its draft rollout (`draft`), its training logits (`training_blocks`) and what it can do
(`supports_batched`, `has_head`). The engine, batched decoding, the training objective, the bench, the CLIs and
the dashboard ask the drafter or this registry; none of them branches on a method name.

Adding a method = one new module here with a registered class + its module name in FAMILY_MODULES.
"""
from __future__ import annotations

import importlib

from ..errors import UserError

FAMILY_MODULES = ("block", "eagle")

_FAMILIES: dict[str, type] = {}


def register(*names: str):
    """Class decorator: the family answers for each of `names` (DrafterConfig.method)."""
    def deco(cls):
        for n in names:
            _FAMILIES[n] = cls
        return cls
    return deco


def _load() -> None:
    for m in FAMILY_MODULES:
        importlib.import_module(f".{m}", __package__)


def names() -> tuple[str, ...]:
    _load()
    return tuple(_FAMILIES)


def family(method: str) -> type:
    """The Drafter subclass of `method`."""
    _load()
    if method not in _FAMILIES:
        raise UserError(f"unknown drafter method '{method}'; use one of {list(_FAMILIES)}")
    return _FAMILIES[method]
