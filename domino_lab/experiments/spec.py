"""Experiment specs: YAML in experiments/specs/NAME.yaml -> typed dataclasses, validated before anything runs.

A spec names the drafters to train (`runs`: a recipe, or a sweep's trial configuration, plus overrides), the
ways to evaluate them (`variants`: head on/off, FR-Spec K, or `ar` = the target alone), and what to compare.
Runs are shared between experiments by name: `domino` trained for `same_data` is reused by `head_ablation`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..config import find_file, from_dict, read_yaml
from ..errors import UserError

SPEC_DIR = "experiments/specs"          # in the repository (or the current directory, if it has one)
EXTRAS = ("base_loss", "head_overhead")


@dataclass
class RunSpec:
    """One drafter trained through `domino_lab.train.train` (or an existing checkpoint, never retrained)."""
    name: str
    recipe: str | None = None          # experiments/configs/<recipe>.yaml (or a path)
    sweep: str | None = None           # or: a sweep YAML; the run is its trial config with `params` set
    params: dict = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)
    seeds: list[int] | None = None     # None: the experiment's seeds
    checkpoint: str | None = None      # a checkpoint dir or shipped name: evaluated as is


@dataclass
class Variant:
    """One row of a table: a trained run evaluated in one way, or `ar` (run None: plain target decoding)."""
    name: str
    run: str | None = None
    head: bool = True                  # False: the same weights with the Domino head switched off
    frspec_k: int = 0                  # > 0: draft among the K most frequent training tokens (training-free FR-Spec)
    lookup: int = 0                    # > 0: lookup drafting with this shortest match (InferenceOptions.lookup)
    sets: list[str] | None = None      # restrict to these sets / temperatures / seeds (None: all of the run's)
    temperatures: list[float] | None = None
    seeds: list[int] | None = None


@dataclass
class ExperimentSpec:
    name: str
    title: str
    question: str = ""
    paper: str = ""                    # the paper's corresponding numbers, quoted in the report
    reading: str = ""                  # the honest reading of the committed run, written after looking at it
    seeds: list[int] = field(default_factory=lambda: [0])
    runs: list[RunSpec] = field(default_factory=list)
    variants: list[Variant] = field(default_factory=list)
    sets: list[str] = field(default_factory=lambda: ["math", "humaneval"])
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    sampler: str = "rejection"         # at T > 0: rejection, or gumbel (every variant samples plain decoding's text)
    limit: int = 16
    max_new_tokens: int = 96
    compare: list[list[str]] = field(default_factory=list)   # [a, b]: paired per-prompt Δτ of a − b
    extras: list[str] = field(default_factory=list)          # base_loss | head_overhead
    columns: list[str] = field(default_factory=list)         # run config keys shown per row (e.g. drafter.rank)

    def run(self, name: str) -> RunSpec:
        return next(r for r in self.runs if r.name == name)

    def seeds_of(self, v: Variant) -> list[int]:
        if v.run is None:
            return [self.seeds[0]]
        r = self.run(v.run)
        if r.checkpoint:
            return [self.seeds[0]]
        seeds = r.seeds if r.seeds is not None else self.seeds
        return [s for s in seeds if s in v.seeds] if v.seeds is not None else seeds


def spec_path(name: str) -> Path:
    p = Path(name)
    if p.suffix in (".yaml", ".yml"):
        return find_file(p)
    return find_file(Path(SPEC_DIR) / f"{name}.yaml")


def available() -> list[str]:
    return sorted(p.stem for p in find_file(SPEC_DIR).glob("*.yaml"))


def load_spec(name: str) -> ExperimentSpec:
    path = spec_path(name)
    if not path.exists():
        names = available()
        raise UserError(f"no experiment '{name}' ({path} does not exist); choose one of {names or '[]'} "
                        "or pass a spec .yaml")
    return parse_spec(read_yaml(path), default_name=path.stem, where=str(path))


def _build(cls, data, where: str):
    """A typed spec section (the shared config conversion); errors name the file and the key."""
    try:
        return from_dict(cls, data, what="key")
    except UserError as e:
        raise UserError(f"{where}: {e}") from None


def parse_spec(raw: dict, default_name: str, where: str) -> ExperimentSpec:
    raw = dict(raw)
    raw.setdefault("name", default_name)
    runs = raw.pop("runs", None) or {}
    variants = raw.pop("variants", None) or []
    if not isinstance(runs, dict) or not isinstance(variants, list):
        raise UserError(f"{where}: 'runs' must map names to run specs and 'variants' must be a list")
    spec = _build(ExperimentSpec, raw, where)
    spec.runs = [_build(RunSpec, dict(v or {}, name=k), f"{where}: runs.{k}") for k, v in runs.items()]
    spec.variants = [_build(Variant, v, f"{where}: variants[{i}]") for i, v in enumerate(variants)]
    validate(spec, where)
    return spec


def validate(spec: ExperimentSpec, where: str) -> None:
    from ..data.eval_sets import EVAL_SETS

    runs = {r.name for r in spec.runs}
    for r in spec.runs:
        if sum(x is not None for x in (r.recipe, r.sweep, r.checkpoint)) != 1:
            raise UserError(f"{where}: run '{r.name}' needs exactly one of recipe, sweep or checkpoint")
        if r.params and not r.sweep:
            raise UserError(f"{where}: run '{r.name}' has params but no sweep")
    names = [v.name for v in spec.variants]
    if not names or len(set(names)) != len(names):
        raise UserError(f"{where}: variants need unique names (got {names})")
    for v in spec.variants:
        if v.run is not None and v.run not in runs:
            raise UserError(f"{where}: variant '{v.name}' uses run '{v.run}', which is not under runs: "
                            f"{sorted(runs)}")
        if v.run is None and (not v.head or v.frspec_k or v.lookup):
            raise UserError(f"{where}: variant '{v.name}' has no run (the target alone) but sets "
                            "head/frspec_k/lookup")
        if v.frspec_k < 0 or v.lookup < 0:
            raise UserError(f"{where}: variant '{v.name}': frspec_k and lookup must be >= 0")
    for s in spec.sets + [s for v in spec.variants for s in (v.sets or [])]:
        if s not in EVAL_SETS:
            raise UserError(f"{where}: unknown eval set '{s}'; use {list(EVAL_SETS)}")
    if any(t < 0 for t in spec.temperatures):
        raise UserError(f"{where}: temperatures must be >= 0")
    from ..cli_flags import SAMPLERS
    if spec.sampler not in SAMPLERS:
        raise UserError(f"{where}: unknown sampler '{spec.sampler}'; use one of {list(SAMPLERS)}")
    for pair in spec.compare:
        if len(pair) != 2 or not set(pair) <= set(names):
            raise UserError(f"{where}: compare entries are [a, b] pairs of variant names, got {pair}")
    bad = set(spec.extras) - set(EXTRAS)
    if bad:
        raise UserError(f"{where}: unknown extras {sorted(bad)}; use {list(EXTRAS)}")
    if spec.limit < 1 or spec.max_new_tokens < 1 or not spec.seeds:
        raise UserError(f"{where}: limit and max_new_tokens must be >= 1 and seeds non-empty")
