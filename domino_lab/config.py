"""Typed configs from YAML: nested dataclasses, unknown keys and wrong types are errors that name the key.

`load_config(TrainConfig, "experiments/configs/domino.yaml", ["loss.gamma=5", "max_steps=200"])`

This is the one reader of config files (recipes, sweeps, experiment specs, pretraining recipes), so every
command finds them, and the paths inside them, the same way wherever it runs:

- a config file named by a relative path is read from the current directory when it is there, otherwise from the
  repository (the folder that holds the `domino_lab` package), so `experiments/configs/domino.yaml` works from
  any directory;
- fields declared with `path_field` are paths (or lists of paths): one that starts with `runs/` lives under the
  command's runs folder
  (`--runs-dir`, default `<repository>/runs`), another relative one is taken from the current directory when it
  exists there, else from the repository when it names something of it (`domino_lab/assets/target`), else as
  given. Absolute paths and names such as `default` are kept.
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

PACKAGE_DIR = Path(__file__).resolve().parent
# A source checkout (or an editable install) keeps recipes, sweeps and specs next to the package; a wheel
# installed elsewhere has none, and then the current directory stands in for the repository.
REPO_ROOT = PACKAGE_DIR.parent if (PACKAGE_DIR.parent / "experiments").is_dir() else None
RUNS_PREFIX = "runs"


def repo_root() -> Path:
    return REPO_ROOT if REPO_ROOT is not None else Path.cwd()


def default_runs_dir() -> Path:
    """Where commands write when not given --runs-dir: <repository>/runs."""
    return repo_root() / RUNS_PREFIX


def path_field(default: str | None = None, **kw):
    """A dataclass field holding a path (or, with `default_factory=list`, a list of paths), resolved by
    `load_config` (see the module docstring)."""
    if "default_factory" not in kw:
        kw["default"] = default
    return dataclasses.field(metadata={"path": True}, **kw)


def find_file(path: str | Path) -> Path:
    """A file the user or a config names: as given if absolute or present under the current directory, else the
    repository's file of that name if there is one, else as given (so an error names what was asked for)."""
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists():
        return p
    in_repo = repo_root() / p
    return in_repo if in_repo.exists() else p


def resolve_path(value: str | None, runs_dir: str | Path | None = None) -> str | None:
    """A config path made independent of the current directory (see the module docstring)."""
    if not value:
        return value
    p = Path(value).expanduser()
    if p.is_absolute():
        return str(p)
    if p.parts[0] == RUNS_PREFIX:
        root = Path(runs_dir).expanduser().resolve() if runs_dir is not None else default_runs_dir()
        return str(root.joinpath(*p.parts[1:]))
    if p.exists():
        return str(p.resolve())
    if (repo_root() / p.parts[0]).exists():
        return str(repo_root() / p)
    return value


def resolve_paths(cfg, runs_dir: str | Path | None = None):
    """Resolve every `path_field` of a (nested) dataclass config in place; returns it."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            resolve_paths(value, runs_dir)
        elif f.metadata.get("path") and isinstance(value, str):
            setattr(cfg, f.name, resolve_path(value, runs_dir))
        elif f.metadata.get("path") and isinstance(value, list):
            setattr(cfg, f.name, [resolve_path(v, runs_dir) if isinstance(v, str) else v for v in value])
    return cfg


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


def from_dict(cls: type[T], data: dict, prefix: str = "", what: str = "config key") -> T:
    if not isinstance(data, dict):
        raise UserError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise UserError(f"unknown {what} '{prefix}{unknown[0]}'; known keys here: {sorted(names)}")
    kwargs = {k: _check(v, hints[k], prefix + k) for k, v in data.items()}
    missing = sorted(f.name for f in dataclasses.fields(cls) if f.name not in kwargs and f.init
                     and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    if missing:
        raise UserError(f"missing {what} '{prefix}{missing[0]}'")
    return cls(**kwargs)


def apply_override(data: dict, assignment: str) -> None:
    """'a.b=value' (value parsed as YAML) into a nested dict."""
    if "=" not in assignment:
        raise UserError(f"override '{assignment}' must look like key=value (e.g. loss.gamma=5)")
    key, raw = assignment.split("=", 1)
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise UserError(f"override '{assignment}': the value is not valid YAML ({str(e).splitlines()[0]}); quote "
                        "text, and close brackets: key=[1, 2]") from None
    node, parts = data, key.strip().split(".")
    # a mapping keyed by dotted names (a sweep's space: 'drafter.rank') is addressed by the longest name it holds:
    # space.drafter.rank.low=8 sets 'low' of 'drafter.rank'
    while len(parts) > 1 and ".".join(parts) not in node:
        j = next((j for j in range(len(parts) - 1, 1, -1) if ".".join(parts[:j]) in node), 1)
        node = node.setdefault(".".join(parts[:j]), {})
        if not isinstance(node, dict):
            raise UserError(f"override '{assignment}': '{'.'.join(parts[:j])}' is not a section")
        parts = parts[j:]
    node[".".join(parts)] = value


def read_yaml(path: str | Path) -> dict:
    """The mapping a YAML config file holds (found with `find_file`); every config file is read here."""
    found = find_file(path)
    try:
        data = yaml.safe_load(found.read_text()) or {}
    except FileNotFoundError:
        raise UserError(f"cannot read config {path}: file not found") from None
    except OSError as e:
        raise UserError(f"cannot read config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise UserError(f"config {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"config {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); "
                        "save it as UTF-8") from None
    if not isinstance(data, dict):
        raise UserError(f"config {path} must be a mapping of keys to values")
    return data


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None,
                runs_dir: str | Path | None = None) -> T:
    """`cls` from the YAML file `path` (None: the defaults) and `key=value` overrides, its path fields resolved
    (`runs/...` under `runs_dir`; without it, under the config's own `runs_dir` field when it has one set, else
    under <repository>/runs)."""
    data: dict = read_yaml(path) if path is not None else {}
    for o in overrides or []:
        apply_override(data, o)
    cfg = from_dict(cls, data)
    if runs_dir is None:
        runs_dir = getattr(cfg, "runs_dir", None)
    return resolve_paths(cfg, runs_dir)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def flat_keys(d: dict, prefix: str = "") -> dict:
    """A nested config as flat `a.b: value` pairs, the keys overrides use (tuples as lists, as JSON and YAML give
    them back)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat_keys(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out


def changed_keys(old: dict, new: dict) -> list[str]:
    """The keys of two flat configs whose values differ, sorted. A key only one side has is an option added or
    removed by another domino_lab version, no conflict."""
    return [k for k in sorted(old) if k in new and old[k] != new[k]]
