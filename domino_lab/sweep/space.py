"""The search space: YAML -> Optuna `suggest_*` calls, validated before any trial runs; samplers and pruners."""
from __future__ import annotations

import math
from typing import Any

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
            raise UserError(f"space.{name}: needs 'type' in {list(PARAM_TYPES)}")
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
    """One admissible value per parameter (fixed value, first or last choice, low or high end, as `end` says):
    the names, and both ends of every range, are checked with a trial config of each."""
    first = end == "low"
    return {name: (spec.get("value") if spec["type"] == "fixed" else
                   spec["choices"][0 if first else -1] if spec["type"] == "categorical" else spec[end])
            for name, spec in space.items()}


def suggest(trial, space: dict) -> dict[str, Any]:
    out = {}
    for name, spec in space.items():
        t = spec["type"]
        if t == "int":
            out[name] = trial.suggest_int(name, int(spec["low"]), int(spec["high"]), log=bool(spec.get("log")),
                                          step=int(spec.get("step", 1)))
        elif t == "float":
            out[name] = trial.suggest_float(name, float(spec["low"]), float(spec["high"]), log=bool(spec.get("log")),
                                            step=spec.get("step"))
        elif t == "categorical":
            out[name] = trial.suggest_categorical(name, spec["choices"])
        else:
            out[name] = spec["value"]
            trial.set_user_attr(name, spec["value"])
    return out


def _build(kind_registry: dict, spec: dict, what: str, default: str):
    spec = dict(spec)
    kind = spec.pop("type", default)
    if kind not in kind_registry:
        raise UserError(f"unknown {what} '{kind}'; use one of {sorted(kind_registry)}")
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
