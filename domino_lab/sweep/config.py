"""SweepConfig (a sweep YAML, experiments/sweeps/*.yaml), read and checked by `load_sweep` before any study,
data or run exists, and `trial_config`: the TrainConfig of one trial."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..config import RUNS_PREFIX, changed_keys, default_runs_dir, flat_keys, load_config, path_field, repo_root
from ..errors import UserError, mask_credentials
from .space import make_pruner, make_sampler, probes, validate_space

DEFAULT_SWEEP = "experiments/sweeps/default.yaml"
# τ alone, or τ against one draft cost (draft_cost = draft step ÷ plain step, measured in turn: steadier across trials)
OBJECTIVES = (["tau"], ["tau", "draft_ms"], ["tau", "draft_cost"])


@dataclass
class ConfirmOptions:
    """The confirmation stage after the search (confirm.py, run_confirmation): the best trial(s) and the baseline trained
    again with more seeds, compared prompt by prompt on held-out prompts the search never scored."""
    seeds: int = 0          # extra training seeds per confirmed configuration (0: no confirmation stage)
    top: int = 1            # how many of the best trials to confirm against the baseline
    # held-out prompts of the comparison, taken from the validation split after the search's eval.tau_prompts
    # (None: as many as the search scores, so the seed noise measured here is that of a trial's score)
    prompts: int | None = None


@dataclass
class SweepConfig:
    study_name: str = "domino-default"
    base_config: str | None = "experiments/configs/domino.yaml"
    overrides: list[str] = field(default_factory=list)
    n_trials: int = 6                      # per worker process (Optuna counts per optimize() call)
    # study-wide goal: every worker stops once the study holds this many finished (complete or pruned)
    # trials, so a re-run after a kill, or several workers, continue to this count instead of adding n_trials
    total_trials: int | None = None
    timeout_min: float | None = None       # stop starting new trials after this many minutes; None: no limit
    storage: str | None = None             # None: sqlite under out_dir; postgresql://... for many workers
    # the runs folder: `runs/...` paths of the recipe (training data), the default MLflow store
    # (<runs_dir>/mlflow.db and mlartifacts/); None: <repository>/runs. --runs-dir sets it and out_dir.
    runs_dir: str | None = None
    out_dir: str = path_field("runs/sweeps")   # optuna.db, trial checkpoints, plots, summary
    target: str | None = None              # overrides the base recipe's target
    seed: int | None = None                # sampler seed and every trial's training seed
    # a killed worker's RUNNING trial is marked FAIL (and retried once) when its heartbeat is this stale
    heartbeat_interval: int = 30
    grace_period: int = 90
    experiment: str = "domino-lab-sweeps"
    tracking_uri: str | None = None        # None: sqlite:///<runs_dir>/mlflow.db
    sampler: dict = field(default_factory=lambda: {"type": "tpe", "seed": 0})
    pruner: dict = field(default_factory=lambda: {"type": "median"})
    objectives: list[str] = field(default_factory=lambda: ["tau"])    # tau | draft_ms | draft_cost
    space: dict = field(default_factory=dict)
    enqueue_defaults: bool = True          # trial 0 = the base recipe's own values, the baseline to beat
    # training data, created on first use when missing (embedded default: regenerate it)
    regen_math: int = 1200
    regen_code: int = 600
    regen_max_new_tokens: int = 160
    confirm: ConfirmOptions = field(default_factory=ConfirmOptions)


def load_sweep(path: str | Path | None = DEFAULT_SWEEP, overrides: list[str] = (),
               runs_dir: str | Path | None = None) -> SweepConfig:
    """The sweep YAML at `path` with `key=value` overrides, checked: the space, the objectives, and every swept
    name being a real training option (so a typo fails now, before any study or data is created).
    `runs_dir` puts everything the sweep writes under one folder: it is both the runs folder and out_dir."""
    overrides = list(overrides)
    if runs_dir is not None:
        root = Path(runs_dir).expanduser().resolve()
        overrides += [f"runs_dir={json.dumps(str(root))}", f"out_dir={json.dumps(str(root))}"]
    cfg = load_config(SweepConfig, path, overrides)
    for key, low in (("regen_math", 0), ("regen_code", 0), ("regen_max_new_tokens", 1)):
        if getattr(cfg, key) < low:
            raise UserError(f"{key} must be >= {low} (the training data a sweep regenerates when it has none), got "
                            f"{getattr(cfg, key)}")
    cfg.runs_dir = str(Path(cfg.runs_dir).expanduser().resolve()) if cfg.runs_dir else str(default_runs_dir())
    validate_space(cfg.space)
    if cfg.seed is not None:
        cfg.sampler = dict(cfg.sampler, seed=cfg.seed)
    try:
        for values in probes(cfg.space):
            trial_config(cfg, values, 0)
    except UserError as e:
        raise UserError(f"sweep {path}: {e}") from None
    if cfg.n_trials < 1:
        raise UserError("n_trials must be >= 1")
    if cfg.total_trials is not None and cfg.total_trials < 1:
        raise UserError("total_trials must be >= 1 (or left out)")
    check_timeout(cfg.timeout_min)
    c = cfg.confirm
    if not (_whole(c.seeds) and c.seeds >= 0 and _whole(c.top) and c.top >= 1
            and (c.prompts is None or (_whole(c.prompts) and c.prompts >= 2))):
        raise UserError(f"confirm: seeds must be >= 0, top >= 1 and prompts >= 2 (or left out), got seeds={c.seeds!r}, "
                        f"top={c.top!r}, prompts={c.prompts!r}")
    base = trial_config(cfg, {}, 0)
    if base.drafter.init_from:      # the warm start's source is read now, not when the first trial starts
        from ..training.config import init_source_config

        init_source_config(base.drafter.init_from)
    # what a worker opens besides trials (the tracking URI is checked with the trial configs above), before any
    # study, database or data exists
    make_sampler(cfg.sampler)
    make_pruner(cfg.pruner)
    check_storage_url(cfg.storage)
    if cfg.objectives not in OBJECTIVES:
        raise UserError(f"objectives must be [tau] or τ against one draft cost, [tau, draft_ms] or [tau, draft_cost] "
                        f"(draft step ÷ plain step, measured in turn: steadier across trials); got {cfg.objectives}")
    return cfg


def check_timeout(minutes: float | None) -> None:
    """No limit is written as leaving timeout_min out (null); 0 or a negative time would stop the worker before
    its first trial, or, read as false, silently mean no limit."""
    if minutes is not None and not (math.isfinite(minutes) and minutes > 0):
        raise UserError(f"timeout_min (--timeout) must be a number of minutes > 0, got {minutes!r}; leave it out "
                        "for no limit")


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_storage_url(url: str | None) -> None:
    """An Optuna storage URL SQLAlchemy can parse, with a dialect it knows (no connection is made), naming a
    database that outlives the worker."""
    if url is None:
        return
    import sqlalchemy as sa

    try:
        parsed = sa.engine.make_url(url)
        parsed.get_dialect()
    except Exception as e:   # a malformed URL, an unknown dialect, a missing driver module
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(mask_credentials(f"--storage {url} is not a database URL Optuna can open ({first}); use "
                                         "sqlite:///PATH or postgresql://...")) from None
    if parsed.get_backend_name() == "sqlite" and parsed.database in (None, "", ":memory:"):
        # an in-memory database: every trial would be lost when the worker ends, and no other worker could join
        raise UserError(f"--storage {url} is an in-memory SQLite database, gone when the worker ends; name a file, "
                        "e.g. sqlite:///runs/sweeps/optuna.db")


def trial_config(sweep: SweepConfig, params: dict, trial_number: int, seed: int | None = None,
                 out_dir: str | Path | None = None, extra: list[str] = ()):
    """The TrainConfig of one trial: base recipe, sweep overrides, then the sampled values. The confirmation
    stage trains the same configuration again with another `seed` into its own `out_dir` (`extra`: overrides
    applied last)."""
    from ..training.config import TrainConfig

    out = out_dir or Path(sweep.out_dir) / sweep.study_name / f"trial_{trial_number:04d}"
    ov = list(sweep.overrides) + [f"{k}={json.dumps(v)}" for k, v in params.items()]
    # (names and URLs as JSON strings: an override's value is read as YAML, where `#` starts a comment)
    ov += [f"out_dir={json.dumps(str(out))}", f"run_name=trial-{trial_number}",
           f"experiment={json.dumps(sweep.experiment)}",
           "progress_bar=false"]     # the sweep prints its own progress; Lightning's bars would interleave
    if sweep.tracking_uri:
        ov.append(f"tracking_uri={json.dumps(sweep.tracking_uri)}")
    if sweep.target:
        ov.append(f"target={json.dumps(sweep.target)}")
    if sweep.seed is not None:
        ov.append(f"seed={sweep.seed}")
    if seed is not None:
        ov.append(f"seed={seed}")
    return load_config(TrainConfig, sweep.base_config, ov + list(extra), runs_dir=sweep.runs_dir)


def base_values(base_cfg, space: dict) -> dict:
    """The base recipe's own values for the swept parameters (enqueued as the baseline trial)."""
    out = {}
    for name, spec in space.items():
        node = base_cfg
        for part in name.split("."):
            node = getattr(node, part, None)
        if node is None or spec["type"] == "fixed":
            continue
        if spec["type"] == "categorical" and node not in spec["choices"]:
            continue
        if spec["type"] in ("int", "float") and not spec["low"] <= node <= spec["high"]:
            continue
        out[name] = node
    return out


# Recipe keys that say where a trial writes and logs, or how fast it runs, not what its score measures. The seed is
# one too: it draws a trial's noise, and workers joining a study take their own --seed so their samplers differ.
NOT_IN_FINGERPRINT = {"seed", "out_dir", "run_name", "experiment", "tracking_uri", "progress_bar", "threads",
                      "log_every_n_steps", "checkpoint_every_n_steps", "data.num_workers", "data.features_dir"}


def study_fingerprint(sweep: SweepConfig, base) -> dict:
    """What decides what a trial's score means, as flat `key: value` pairs (the keys overrides use): the resolved base
    recipe `base` (training budget, data, drafter, loss, optimiser, eval settings) but NOT_IN_FINGERPRINT, the search
    space, the objectives and the counts the sweep regenerates missing data with. Budget (n_trials, total_trials,
    timeout), storage, runs folder, sampler, pruner and confirmation settings are left out: re-runs and workers
    legitimately differ in them, and none changes a trial's score. JSON-shaped, as the study's storage returns it."""
    fp = {k: portable(v, sweep.runs_dir) for k, v in flat_keys(dataclasses.asdict(base)).items()
          if k not in NOT_IN_FINGERPRINT}
    fp["space"] = sorted(sweep.space)       # the swept names, so an added or removed parameter shows too
    fp.update({f"space.{name}": spec for name, spec in sweep.space.items()})
    fp.update(objectives=sweep.objectives, regen_math=sweep.regen_math, regen_code=sweep.regen_code,
              regen_max_new_tokens=sweep.regen_max_new_tokens)
    return json.loads(json.dumps(fp))


def fingerprint_changes(old: dict, new: dict) -> list[str]:
    """`key old → new` for every key whose value differs (config.changed_keys: the space's names are compared as
    one key)."""
    return [f"{k} {json.dumps(old[k])} → {json.dumps(new[k])}" for k in changed_keys(old, new)]


def portable(value, runs_dir: str):
    """A path under the runs folder (or the repository) written as the recipe writes it, `runs/...`: workers on
    other machines, with other folders and one shared database, describe the same study alike."""
    if isinstance(value, list):
        return [portable(v, runs_dir) for v in value]
    if isinstance(value, str) and Path(value).is_absolute():
        for root, prefix in ((Path(runs_dir), RUNS_PREFIX), (repo_root(), "")):
            if Path(value).is_relative_to(root):
                return str(Path(prefix, Path(value).relative_to(root)))
    return value
