"""Train (or reuse) the drafters an experiment needs, through the one training path (`domino_lab.train.train`).

A run lives in <runs_dir>/<name>-s<seed>; a finished one (result.json) is reused, an interrupted one resumes
from its last checkpoint. Runs are shared between experiments by name, so `domino` trains once for all. The config
a run was trained with is recorded beside its result (CONFIG_RECORD): a spec or --quick that now asks another
drafter of that folder is refused rather than handed the old one.
"""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError, atomic_path
from .spec import ExperimentSpec, RunSpec

# The embedded default's training data (experiments/configs/*.yaml data.path): made on first use like this
DEFAULT_DATA = {"math": 10500, "code": 9500, "max_new_tokens": 128}

# --quick: a few optimiser steps on a small regenerated set, enough to exercise every code path end to end
QUICK_TRAIN = ["max_steps=4", "eval.every_n_steps=4", "eval.tau_prompts=2", "eval.tau_max_new_tokens=12",
               "eval.val_batches=1", "loss.num_anchors=8", "data.batch_size=2", "data.max_length=128",
               "checkpoint_every_n_steps=4", "drafter.gru_hidden=32", "drafter.rank=8"]
QUICK_DATA = {"math": 12, "code": 8, "max_new_tokens": 32}

CONFIG_RECORD = "trained_config.json"   # what a run folder's drafter was trained with (config_record), with its hash


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
    if tracking_uri:      # (as a JSON string: an override's value is read as YAML)
        ov.append(f"tracking_uri={json.dumps(tracking_uri)}")
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


def config_record(cfg, runs_root: str | Path | None = None) -> dict:
    """What decides the drafter of a run folder: its resolved training config as flat `key: value` pairs, without
    what only says where it writes and logs or how fast it runs (the sweep fingerprint's NOT_IN_FINGERPRINT; the
    seed is in the folder's name) and with paths under the runs folder written `runs/...` (a moved runs folder
    holds the same drafters), and the hash of those pairs."""
    from ..config import default_runs_dir, flat_keys, to_dict
    from ..sweep.config import NOT_IN_FINGERPRINT, portable

    root = str(runs_root or default_runs_dir())
    flat = {k: portable(v, root) for k, v in flat_keys(to_dict(cfg)).items() if k not in NOT_IN_FINGERPRINT}
    flat = json.loads(json.dumps(flat))         # JSON-shaped, as it is read back
    return {"sha1": hashlib.sha1(json.dumps(flat, sort_keys=True).encode()).hexdigest(), "config": flat}


def check_reuse(cfg, runs_root: str | Path | None = None) -> None:
    """A finished run folder is reused only for the config it was trained with: another (the spec's recipe or
    overrides changed, or --quick's short training against a full one in one --runs-dir) is one error naming what
    differs, before anything is trained. A folder from before the record was kept has none and is reused as is."""
    from ..config import changed_keys

    out = Path(cfg.out_dir)
    try:
        old = json.loads((out / CONFIG_RECORD).read_text())["config"]
        if not isinstance(old, dict):
            raise TypeError("not a config")
    except FileNotFoundError:
        return
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"cannot read {out / CONFIG_RECORD} ({e}); delete {out} to train that run again") from None
    new = config_record(cfg, runs_root)["config"]
    # (a key only one side has is an option another domino_lab version added or removed: no conflict)
    changes = [f"{k} {json.dumps(old[k])} → {json.dumps(new[k])}" for k in changed_keys(old, new)]
    if changes:
        more = f" (and {len(changes) - 3} more)" if len(changes) > 3 else ""
        raise UserError(f"{out} holds a drafter trained with another config than this run asks for: "
                        f"{'; '.join(changes[:3])}{more}; delete that folder to train it again, or use another "
                        "--runs-dir to keep both")


def train_runs(resolved: list, runs_dir: Path, quick: bool, runs_root: str | Path | None = None) -> dict:
    """{(run name, seed): TrainedRun}: finished runs are reused, the others trained (or resumed). `runs_root`: the
    runs folder whose `runs/...` paths the recipes use (default <repository>/runs)."""
    from ..config import to_dict
    from ..target import Target
    from ..train import latest_checkpoint, train
    from ..training.tracking import open_tracking_store

    for _, _, cfg, _ in resolved:
        if cfg is not None:
            check_reuse(cfg, runs_root)
    # every target a run to train needs is loaded before any folder is made, so a bad target= leaves none behind
    targets = {}
    to_train = [cfg for _, _, cfg, _ in resolved
                if cfg is not None and not (Path(cfg.out_dir) / "result.json").exists()]
    for cfg in to_train:
        if cfg.target not in targets:
            targets[cfg.target] = Target.from_pretrained(cfg.target, dtype=cfg.dtype)
    # and the tracking store the runs log to answers: an unreachable or damaged one fails here, not mid-training
    for uri in sorted({cfg.tracking_uri for cfg in to_train if cfg.tracking_uri}):
        open_tracking_store(uri)
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
            with atomic_path(Path(cfg.out_dir) / CONFIG_RECORD) as tmp:
                tmp.write_text(json.dumps(config_record(cfg, runs_root), indent=1))
        res = json.loads(result_file.read_text())
        out[(r.name, seed)] = TrainedRun(r.name, seed, res.get("best_dir") or res["final_dir"], cfg.out_dir,
                                         res.get("run_id"), to_dict(cfg))
    return out
