"""Typed configs from YAML: nested dataclasses, unknown keys and wrong types are errors that name the key.

`load_config(TrainConfig, "experiments/configs/domino.yaml", ["loss.gamma=5", "max_steps=200"])`
"""
from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from .errors import UserError

T = TypeVar("T")


def _check(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _check(value, a, key)
            except UserError as e:
                errors.append(e)
        raise errors[0] if errors else UserError(f"{key}: unexpected value {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise UserError(f"{key}: expected a mapping, got {type(value).__name__}")
        return from_dict(tp, value, prefix=f"{key}.")
    if origin is list:
        if not isinstance(value, list):
            raise UserError(f"{key}: expected a list, got {value!r}")
        (inner,) = typing.get_args(tp) or (Any,)
        return [_check(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise UserError(f"{key}: expected a mapping, got {value!r}")
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        # PyYAML (YAML 1.1) reads 3e-3 as a string; accept any float literal Python accepts
        try:
            return float(value)
        except ValueError:
            raise UserError(f"{key}: expected float, got {value!r}") from None
    if tp in (int, float, str, bool):
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise UserError(f"{key}: expected {tp.__name__}, got {value!r}")
        return value
    return value


def from_dict(cls: type[T], data: dict, prefix: str = "") -> T:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise UserError(f"unknown config key '{prefix}{unknown[0]}'; known keys here: {sorted(names)}")
    kwargs = {k: _check(v, hints[k], prefix + k) for k, v in data.items()}
    return cls(**kwargs)


def apply_override(data: dict, assignment: str) -> None:
    """'a.b=value' (value parsed as YAML) into a nested dict."""
    if "=" not in assignment:
        raise UserError(f"override '{assignment}' must look like key=value (e.g. loss.gamma=5)")
    key, raw = assignment.split("=", 1)
    node = data
    parts = key.strip().split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise UserError(f"override '{assignment}': '{p}' is not a section")
    node[parts[-1]] = yaml.safe_load(raw)


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    data: dict = {}
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as e:
            raise UserError(f"cannot read config {path}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise UserError(f"config {path} is not valid YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise UserError(f"config {path} must be a mapping of keys to values")
    for o in overrides or []:
        apply_override(data, o)
    return from_dict(cls, data)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
