"""Train (or reuse) the drafters an experiment needs, through the one training path (`domino_lab.train.train`).

A run lives in <runs_dir>/<name>-s<seed>; a finished one (result.json) is reused, an interrupted one resumes
from its last checkpoint. Runs are shared between experiments by name, so `domino` trains once for all.
"""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from .spec import ExperimentSpec, RunSpec

# The embedded default's training data (experiments/configs/*.yaml data.path): made on first use like this
DEFAULT_DATA = {"math": 10500, "code": 9500, "max_new_tokens": 128}

# --quick: a few optimiser steps on a small regenerated set, enough to exercise every code path end to end
QUICK_TRAIN = ["max_steps=4", "eval.every_n_steps=4", "eval.tau_prompts=2", "eval.tau_max_new_tokens=12",
               "eval.val_batches=1", "loss.num_anchors=8", "data.batch_size=2", "data.max_length=128",
               "checkpoint_every_n_steps=4", "drafter.gru_hidden=32", "drafter.rank=8"]
QUICK_DATA = {"math": 12, "code": 8, "max_new_tokens": 32}


@dataclass
class TrainedRun:
    name: str
    seed: int
    path: str               # drafter directory (best by val τ, else final) or the checkpoint spec
    out_dir: str | None     # training folder (None for a given checkpoint)
    run_id: str | None      # MLflow run (base-loss curves)
    config: dict            # resolved training config (for the report's columns)


def run_config(spec: RunSpec, seed: int, runs_dir: Path, quick_data: str | None, tracking_uri: str | None,
               extra: list[str] = (), runs_root: str | Path | None = None):
    """(TrainConfig, sweep config or None) of one run: recipe or sweep trial config, the run's overrides, then the
    command line's (`extra`, e.g. target=Qwen/Qwen3-8B data.path=...: the same experiment on another target).
    `runs/...` paths of the recipe (its training data) resolve under `runs_root` (default <repository>/runs)."""
    from ..config import find_file, load_config
    from ..training.config import TrainConfig

    sweep = None
    if spec.sweep:
        from ..sweep import load_sweep
        sweep = load_sweep(spec.sweep)
        base, ov = sweep.base_config, list(sweep.overrides) + [f"{k}={json.dumps(v)}" for k, v in spec.params.items()]
    else:
        base = spec.recipe if spec.recipe.endswith((".yaml", ".yml")) else f"experiments/configs/{spec.recipe}.yaml"
        if not find_file(base).exists():
            raise UserError(f"run '{spec.name}': no recipe {base}")
        ov = []
    # command-line overrides make different drafters: their own folder, never a default-target run reused by name
    tag = "-" + hashlib.sha1(" ".join(extra).encode()).hexdigest()[:8] if extra else ""
    out = runs_dir / f"{spec.name}-s{seed}{tag}"
    ov += list(spec.overrides) + list(extra) + [f"seed={seed}", f"out_dir={json.dumps(str(out))}",
                                                f"run_name={spec.name}-s{seed}", "experiment=experiments",
                                                "progress_bar=false"]
    user_keys = {_key(o) for o in extra}
    if quick_data:
        # --quick's values fill in only what was not set: a run that sweeps rank/g keeps its own values, and a key
        # given on the command line wins (so the user's value is the one checked and used, never silently replaced)
        keep = {_key(k) for k in list(spec.params) + list(spec.overrides)} | user_keys
        ov += [o for o in QUICK_TRAIN if _key(o) not in keep]
        if "data.path" not in user_keys:
            ov.append(f"data.path={json.dumps(str(quick_data))}")
    if tracking_uri:
        ov.append(f"tracking_uri={tracking_uri}")
    cfg = load_config(TrainConfig, base, ov, runs_dir=runs_root)
    if quick_data and "data.path" in user_keys and not Path(cfg.data.path).exists():
        # --quick makes only its own small data: made at the user's path, it would later pass for full data there
        raise UserError(f"--quick with data.path: {cfg.data.path} does not exist; leave data.path out to use "
                        "--quick's own small data, or name regenerated data that exists")
    return cfg, sweep


def _key(assignment: str) -> str:
    """The key of a `key=value` override (or of a sweep param name)."""
    return assignment.split("=", 1)[0].strip()


def ensure_data(cfg, target, sweep, quick: bool) -> None:
    """Regenerate the run's training data when it is missing (the target writes it; resumable): as much as the
    run's sweep asks for, else the recipes' default amount (a small set for --quick)."""
    from ..data.regenerate import ensure_regenerated

    if quick or sweep is None:
        d = QUICK_DATA if quick else DEFAULT_DATA
        n_math, n_code, max_new = d["math"], d["code"], d["max_new_tokens"]
    else:
        n_math, n_code, max_new = sweep.regen_math, sweep.regen_code, sweep.regen_max_new_tokens
    ensure_regenerated(cfg.data.path, target, n_math=n_math, n_code=n_code, max_new_tokens=max_new,
                       target_name=cfg.target, log_prefix="[experiments]")


def resolve_runs(spec: ExperimentSpec, runs_dir: Path, quick: bool, tracking_uri: str | None = None,
                 extra: list[str] = (), runs_root: str | Path | None = None) -> list:
    """[(run spec, seed, TrainConfig or None, sweep or None)] for every run the variants use; resolving every
    config first means a bad override fails before anything is created or trained."""
    quick_data = str(runs_dir / "quick-data") if quick else None
    used = {v.run for v in spec.variants if v.run is not None}
    out = []
    for r in spec.runs:
        if r.name not in used:
            continue
        for seed in sorted({s for v in spec.variants if v.run == r.name for s in spec.seeds_of(v)}):
            cfg, sweep = (None, None) if r.checkpoint else run_config(r, seed, runs_dir, quick_data, tracking_uri,
                                                                       extra, runs_root)
            out.append((r, seed, cfg, sweep))
    return out


def train_runs(resolved: list, runs_dir: Path, quick: bool) -> dict:
    """{(run name, seed): TrainedRun}: finished runs are reused, the others trained (or resumed)."""
    from ..config import to_dict
    from ..target import Target
    from ..train import latest_checkpoint, train

    # every target a run to train needs is loaded before any folder is made, so a bad target= leaves none behind
    targets = {}
    for _, _, cfg, _ in resolved:
        if cfg is not None and not (Path(cfg.out_dir) / "result.json").exists() and cfg.target not in targets:
            targets[cfg.target] = Target.from_pretrained(cfg.target, dtype=cfg.dtype)
    runs_dir.mkdir(parents=True, exist_ok=True)
    out = {}
    for r, seed, cfg, sweep in resolved:
        if cfg is None:
            out[(r.name, seed)] = TrainedRun(r.name, seed, r.checkpoint, None, None, {})
            continue
        result_file = Path(cfg.out_dir) / "result.json"
        if not result_file.exists():
            ensure_data(cfg, targets[cfg.target], sweep, quick)
            resume = latest_checkpoint(Path(cfg.out_dir) / "checkpoints") is not None
            print(f"[experiments] training {r.name} seed {seed} -> {cfg.out_dir}", file=sys.stderr)
            train(cfg, resume=resume, target=targets[cfg.target])
        res = json.loads(result_file.read_text())
        out[(r.name, seed)] = TrainedRun(r.name, seed, res.get("best_dir") or res["final_dir"], cfg.out_dir,
                                         res.get("run_id"), to_dict(cfg))
    return out
