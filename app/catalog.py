"""The targets and drafters the dashboard offers, loaded once and shared by every session.

Only names from this catalog are accepted from the browser (no arbitrary paths): the shipped defaults,
drafter checkpoints found under the runs folder, the best trials of MLflow sweeps, and what the command line
adds. Loaded modules are in eval mode and only used under no_grad, so concurrent decodes can share them; a
drafter with its head switched off is a separate instance (the head flag is module state).
"""
from __future__ import annotations

import copy
import json
import threading
from dataclasses import dataclass
from pathlib import Path

from domino_lab.errors import UserError

PLAIN = "none"
SKIP_DIRS = {"checkpoints", "mlartifacts", "regenerated", "__pycache__", ".git"}
MAX_SCAN = 500


@dataclass
class Entry:
    value: str          # what the browser sends back
    label: str          # what the picker shows
    spec: object        # what domino_lab loads: a shipped name, a directory, or a ready Target


def _is_drafter_dir(d: Path) -> bool:
    """A checkpoint of any registered drafter family."""
    from domino_lab.models.drafter import family_of

    return (d / "model.safetensors").is_file() and family_of(str(d)) is not None


def _is_model_dir(d: Path) -> bool:
    try:
        cfg = json.loads((d / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(cfg, dict) and "model_type" in cfg and any(d.glob("*.safetensors"))
            and (d / "tokenizer.json").is_file())


def scan_runs_folder(runs_dir: Path) -> tuple[list[Path], list[Path]]:
    """(drafter checkpoint dirs, HF model dirs) under runs_dir, skipping trainer state and data caches."""
    drafters, models, seen = [], [], 0
    if not runs_dir.is_dir():
        return drafters, models
    stack = [runs_dir]
    while stack and seen < MAX_SCAN:
        d = stack.pop()
        seen += 1
        if (d / "config.json").is_file():
            if _is_drafter_dir(d):
                drafters.append(d)
            elif _is_model_dir(d):
                models.append(d)
        try:
            stack += sorted((c for c in d.iterdir() if c.is_dir() and c.name not in SKIP_DIRS), reverse=True)
        except OSError:
            pass
    return sorted(drafters), sorted(models)


class Catalog:
    def __init__(self, runs_dir: str | Path | None = "runs", tracking_uri: str | None = None,
                 extra_targets: dict | list = (), extra_drafters: list = (), dtype: str = "float32",
                 warmup: bool = True):
        self.runs_dir = Path(runs_dir) if runs_dir else None
        self.tracking_uri = tracking_uri
        self.dtype = dtype
        self.warmup = warmup
        self._extra_targets = extra_targets
        self._extra_drafters = list(extra_drafters)
        self._lock = threading.RLock()
        self._targets: dict = {}
        self._drafters: dict = {}        # per setting: a light copy sharing the weights of _loaded's
        self._loaded: dict = {}          # (target, drafter) -> the drafter loaded once
        self.refresh()

    # ---- what can be picked ----------------------------------------------------------------------
    def refresh(self) -> None:
        targets = [Entry("default", "default (embedded 6.8M Qwen3)", "default")]
        extra = self._extra_targets.items() if isinstance(self._extra_targets, dict) else \
            ((t, t) for t in self._extra_targets)
        targets += [Entry(name, name, spec) for name, spec in extra]
        drafters = [Entry("default", "default (shipped Domino, copy input)", "default"),
                    Entry("default-dflash", "default-dflash (shipped DFlash, copy input)", "default-dflash"),
                    Entry("default-eagle", "default-eagle (shipped EAGLE-style chain)", "default-eagle"),
                    Entry("default-mc", "default-mc (shipped Domino before its prose fine-tune)", "default-mc"),
                    Entry("default-dflash-mc", "default-dflash-mc (shipped DFlash before its prose fine-tune)",
                          "default-dflash-mc"),
                    Entry("default-nocopy", "default-nocopy (shipped Domino without the copy input)",
                          "default-nocopy"),
                    Entry("default-dflash-nocopy", "default-dflash-nocopy (shipped DFlash without the copy input)",
                          "default-dflash-nocopy"),
                    Entry(PLAIN, "none (plain decoding)", None)]
        drafters += [Entry(str(d), str(d), str(d)) for d in self._extra_drafters]
        if self.runs_dir is not None:
            ckpts, models = scan_runs_folder(self.runs_dir)
            drafters += [Entry(str(d), str(d), str(d)) for d in ckpts]
            targets += [Entry(str(d), f"{d} (local model)", str(d)) for d in models]
        drafters += self._sweep_drafters()
        with self._lock:
            self.targets = {e.value: e for e in targets}
            self.drafters = {e.value: e for e in drafters}

    def _sweep_drafters(self) -> list[Entry]:
        from .runs import list_runs, store_problem, sweep_best_trials

        if store_problem(self.tracking_uri):
            return []
        runs, _ = list_runs(self.tracking_uri)
        return [Entry(f"mlflow:{r.run_id}", f"best trial: {r.label}", str(r.checkpoint))
                for r in sweep_best_trials(runs, top=3, latest_only=False) if r.checkpoint]

    def target_choices(self) -> list[tuple[str, str]]:
        return [(e.label, e.value) for e in self.targets.values()]

    def drafter_choices(self, head: bool | None = None) -> list[tuple[str, str]]:
        """All drafters, or only those with (head=True) / without (head=False) a Domino-style head."""
        return [(e.label, e.value) for e in self.drafters.values() if head is None or self.has_head(e.value) == head]

    def has_head(self, value: str) -> bool:
        """Whether the drafter's family has a head that can be switched off (asked of the method registry)."""
        from domino_lab.models.drafter import family_of

        e = self.drafters.get(value)
        fam = family_of(e.spec) if e is not None and e.spec is not None else None
        return bool(fam is not None and fam.has_head)

    # ---- loading (once) --------------------------------------------------------------------------
    def target(self, value: str):
        entry = self.targets.get(value)
        if entry is None:
            raise UserError(f"unknown target {value!r}; pick one from the list")
        if value in self._targets:                  # loaded: no lock, so a slow load never blocks other decodes
            return self._targets[value]
        with self._lock:
            if value not in self._targets:
                from domino_lab import Target, speculative_generate

                t = entry.spec if isinstance(entry.spec, Target) else Target.from_pretrained(entry.spec,
                                                                                             dtype=self.dtype)
                if self.warmup and t.tokenizer is not None:
                    speculative_generate(t, None, prompt_ids=[t.encode("a")[0]] * 4, max_new_tokens=4)
                self._targets[value] = t
            return self._targets[value]

    def drafter(self, target_value: str, value: str, head_on: bool = True, lookup: int = 0,
                tree_min_prob: float = 0.0, adaptive: bool = False, tree_sampled: bool = False):
        """The drafter `value` bound to target `target_value` (None for plain decoding); UserError if it
        doesn't fit the target. `lookup` > 0 turns on lookup drafting, `tree_min_prob` > 0 prunes unlikely tree
        nodes, `adaptive` takes plain steps where drafting does not pay, `tree_sampled` draws tree children at T > 0
        (one cached drafter per setting: options are read by the engine during a decode, so concurrent requests
        must not share a mutable one; each is a shallow copy of the one loaded drafter, sharing its weights, so a
        setting costs a few attributes instead of the drafter's memory)."""
        entry = self.drafters.get(value)
        if entry is None:
            raise UserError(f"unknown drafter {value!r}; pick one from the list")
        target = self.target(target_value)
        if entry.spec is None:
            return None
        key = (target_value, value, bool(head_on), int(lookup), float(tree_min_prob), bool(adaptive),
               bool(tree_sampled))
        if key in self._drafters:
            return self._drafters[key]
        with self._lock:
            if key not in self._drafters:
                from domino_lab import speculative_generate
                from domino_lab.models import InferenceOptions, load_drafter

                try:
                    # full-vocabulary correction: the inspector's corrected top-k and ΔL bounds must be exact
                    options = InferenceOptions(candidate_pool=0, lookup=lookup, tree_min_prob=tree_min_prob,
                                               adaptive_drafts=bool(adaptive), tree_sampled=bool(tree_sampled))
                    base = self._loaded.get(key[:2])
                    if base is None:
                        base = load_drafter(entry.spec, target, options=options).eval()
                        if self.warmup and target.tokenizer is not None:
                            speculative_generate(target, base, prompt_ids=[target.encode("a")[0]] * 4,
                                                 max_new_tokens=8)
                        self._loaded[key[:2]] = base
                except UserError as e:
                    raise UserError(f"{e} (drafter {value!r}, target {target_value!r})") from None
                # the modules, parameters and buffers are shared; the options and the head switch, which the engine
                # reads from the drafter it is handed, are this copy's own
                d = copy.copy(base)
                d.options = options
                d.head_enabled = bool(head_on)
                self._drafters[key] = d
            return self._drafters[key]
