"""The search space: YAML -> Optuna `suggest_*` calls, validated before any trial runs; samplers and pruners."""
from __future__ import annotations

import math
from typing import Any, Iterator

from ..errors import UserError

PARAM_TYPES = ("int", "float", "categorical", "fixed")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def validate_space(space: dict) -> None:
    if not space:
        raise UserError("the sweep has an empty search space; add parameters under 'space:'")
    for name, spec in space.items():
        if not isinstance(spec, dict) or spec.get("type") not in PARAM_TYPES:
            nested = isinstance(spec, dict) and spec and all(isinstance(v, dict) for v in spec.values())
            raise UserError(f"space.{name}: needs 'type' in {list(PARAM_TYPES)}" + (
                f"; a parameter is named by its whole key, e.g. '{name}.{next(iter(spec))}': {{type: ...}} in the "
                "sweep YAML" if nested else ""))
        t = spec["type"]
        if t in ("int", "float"):
            number = _is_int if t == "int" else _is_number
            for key in ("low", "high") + (("step",) if spec.get("step") is not None else ()):
                if t == "float" and isinstance(spec.get(key), str):
                    try:        # PyYAML (YAML 1.1) reads 3e-4 as a string
                        spec[key] = float(spec[key])
                    except ValueError:
                        pass
                if key not in spec or not number(spec[key]):
                    kind = "a whole number" if t == "int" else "a number"
                    raise UserError(f"space.{name}: {t} needs '{key}' to be {kind}, got {spec.get(key)!r}")
            if not spec["low"] < spec["high"]:
                raise UserError(f"space.{name}: {t} needs low < high")
            if not isinstance(spec.get("log", False), bool):
                raise UserError(f"space.{name}: 'log' must be true or false, got {spec['log']!r}")
            if spec.get("log") and spec["low"] <= 0:
                raise UserError(f"space.{name}: a log range needs low > 0")
            if spec.get("step") is not None and (spec["step"] <= 0 or spec.get("log")):
                raise UserError(f"space.{name}: 'step' must be > 0 and cannot be combined with log")
        if t == "categorical" and (not isinstance(spec.get("choices"), list) or not spec["choices"]):
            raise UserError(f"space.{name}: categorical needs a non-empty 'choices' list")
        if t == "fixed" and "value" not in spec:
            raise UserError(f"space.{name}: fixed needs 'value'")
        extra = set(spec) - {"type", "low", "high", "log", "step", "choices", "value"}
        if extra:
            raise UserError(f"space.{name}: unknown key(s) {sorted(extra)}")


def probe_values(space: dict, end: str = "low") -> dict[str, Any]:
    """One admissible value per parameter (fixed value, first or last choice, low or high end, as `end` says)."""
    first = end == "low"
    return {name: (spec.get("value") if spec["type"] == "fixed" else
                   spec["choices"][0 if first else -1] if spec["type"] == "categorical" else spec[end])
            for name, spec in space.items()}


def probes(space: dict) -> Iterator[dict[str, Any]]:
    """Value sets that together hold every name, both ends of every range and every categorical choice: a trial
    config of each checks the whole space before any trial runs (a bad middle choice would otherwise end the
    sweep when the sampler first draws it)."""
    low = probe_values(space, "low")
    yield low
    yield probe_values(space, "high")
    for name, spec in space.items():
        if spec["type"] == "categorical":
            for choice in spec["choices"][1:-1]:
                yield dict(low, **{name: choice})


def suggest(trial, space: dict) -> dict[str, Any]:
    out = {}
    for name, spec in space.items():
        t = spec["type"]
        if t == "int":
            # (step: null is no step, as validate_space reads it)
            out[name] = trial.suggest_int(name, int(spec["low"]), int(spec["high"]), log=bool(spec.get("log")),
                                          step=int(spec.get("step") or 1))
        elif t == "float":
            out[name] = trial.suggest_float(name, float(spec["low"]), float(spec["high"]), log=bool(spec.get("log")),
                                            step=spec.get("step"))
        elif t == "categorical":
            out[name] = trial.suggest_categorical(name, spec["choices"])
        else:
            out[name] = spec["value"]
            trial.set_user_attr(name, spec["value"])
    return out


# what a sampler's or pruner's argument annotation admits, for the simple types its YAML can hold
_ARG_TYPES = {"int": ("a whole number", _is_int), "float": ("a number", _is_number),
              "bool": ("true or false", lambda v: isinstance(v, bool)),
              "str": ("a string", lambda v: isinstance(v, str)),
              "None": ("null", lambda v: v is None)}


def _check_arguments(cls, spec: dict, what: str) -> None:
    """Optuna's samplers and pruners store their arguments unchecked (n_startup_trials: abc is accepted here and
    fails at the first trial that reads it, mid-sweep): every argument annotated with simple types is checked
    against them now. An argument annotated otherwise (a callable, a sampler) is left to the class."""
    import inspect

    params = inspect.signature(cls).parameters
    for key, value in spec.items():
        if key not in params:
            continue            # the class itself names an unknown argument
        ann = params[key].annotation
        names = [n.strip() for n in (ann if isinstance(ann, str) else getattr(ann, "__name__", "")).split("|")]
        if not all(n in _ARG_TYPES for n in names):
            continue
        if not any(_ARG_TYPES[n][1](value) for n in names):
            raise UserError(f"{what}: {key} must be {' or '.join(_ARG_TYPES[n][0] for n in names)}, got {value!r}")


def _build(kind_registry: dict, spec: dict, what: str, default: str):
    spec = dict(spec)
    kind = spec.pop("type", default)
    if kind not in kind_registry:
        raise UserError(f"unknown {what} '{kind}'; use one of {sorted(kind_registry)}")
    _check_arguments(kind_registry[kind], spec, f"{what} {kind}")
    try:
        return kind_registry[kind](**spec)
    except (TypeError, ValueError) as e:      # an unknown argument, or a value the class refuses
        raise UserError(f"{what} {kind}: {e}") from None


def make_sampler(spec: dict):
    import optuna

    s = optuna.samplers
    return _build({"tpe": s.TPESampler, "random": s.RandomSampler, "cmaes": s.CmaEsSampler, "gp": s.GPSampler,
                   "nsga2": s.NSGAIISampler}, spec, "sampler", "tpe")


def make_pruner(spec: dict):
    import optuna

    p = optuna.pruners
    return _build({"median": p.MedianPruner, "hyperband": p.HyperbandPruner, "percentile": p.PercentilePruner,
                   "none": p.NopPruner, "successive_halving": p.SuccessiveHalvingPruner}, spec, "pruner", "median")
