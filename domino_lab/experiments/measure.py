"""Evaluate every variant of an experiment with the real engine: τ, acceptance per position, draft/verify ms,
tokens/s and speedup over plain decoding (`ar`, measured in the same session), and the lossless check."""
from __future__ import annotations

import sys

from .spec import ExperimentSpec, Variant
from .training import TrainedRun

QUICK_EVAL = {"limit": 2, "max_new_tokens": 8}


def load_variant(v: Variant, run: TrainedRun, target, cache: dict):
    """The drafter a variant evaluates: the run's weights, head on/off, FR-Spec restricted to K tokens, lookup
    drafting on or off."""
    import copy
    import dataclasses

    from ..models import load_drafter
    from ..data.regenerate import frequent_tokens_from_dataset
    from ..models.frspec import restrict

    key = (run.path, v.head, v.frspec_k, v.lookup)
    if v.lookup and key not in cache:
        # the same weights with other options: a shallow copy shares the parameters, only `options` differs
        d = copy.copy(load_variant(dataclasses.replace(v, lookup=0), run, target, cache))
        d.options = dataclasses.replace(d.options, lookup=v.lookup)
        cache[key] = d
    if key not in cache:
        base = cache.get((run.path, True, 0, 0)) or load_drafter(run.path, target)
        cache[(run.path, True, 0, 0)] = base
        d = base
        if v.frspec_k:
            data = run.config.get("data", {}).get("path")
            if not data:
                from ..errors import UserError
                raise UserError(f"variant '{v.name}': FR-Spec needs the run's training data to rank tokens")
            d = restrict(base, frequent_tokens_from_dataset(data, v.frspec_k, base.config.vocab_size))
        elif not v.head:
            d = load_drafter(run.path, target)
        if not v.head:
            if not d.has_head:
                from ..errors import UserError
                raise UserError(f"variant '{v.name}': head: false needs a domino drafter, run '{v.run}' has none")
            d.head_enabled = False
        cache[key] = d
    return cache[key]


def _s_per_token(r: dict) -> float:
    return sum(p["wall_s"] for p in r["per_prompt"]) / max(1, sum(p["tokens"] for p in r["per_prompt"]))


def eval_prompts(spec: ExperimentSpec, quick: bool) -> dict:
    """{set: its prompts}, as the experiment measures them (the first `limit`, fewer with --quick)."""
    from ..data.eval_sets import load_eval_set

    limit = QUICK_EVAL["limit"] if quick else spec.limit
    return {s: load_eval_set(s, limit=limit) for s in spec.sets}


def measure(spec: ExperimentSpec, trained: dict, sets: dict, quick: bool, progress: bool = True,
            threads: int | None = None) -> dict:
    """results[set][str(T)][variant][str(seed)] = evaluate() result + speedup, tok_s, lossless, over `sets`
    (`eval_prompts`)."""
    from ..evaluate import differing_prompts, evaluate, must_equal_plain
    from ..target import Target, use_decode_threads

    targets = {r.config.get("target", "default") for r in trained.values() if r.config}
    if len(targets) > 1:
        from ..errors import UserError
        raise UserError(f"an experiment compares drafters of one target; its runs use {sorted(targets)}")
    target = Target.from_pretrained(targets.pop() if targets else "default")
    use_decode_threads(target, threads)
    max_new = QUICK_EVAL["max_new_tokens"] if quick else spec.max_new_tokens
    cache: dict = {}
    results: dict = {}
    for s, prompts in sets.items():
        for temp in spec.temperatures:
            checked = must_equal_plain(temp, spec.sampler)
            print(f"[experiments] {s} T={temp}: {len(prompts)} prompts, {max_new} new tokens", file=sys.stderr)
            ar = evaluate(target, None, prompts, max_new, temp, progress=progress, keep_ids=checked,
                          sampler=spec.sampler)
            cell = results.setdefault(s, {}).setdefault(str(temp), {})
            for v in spec.variants:
                if (v.sets and s not in v.sets) or (v.temperatures is not None and temp not in v.temperatures):
                    continue
                per_seed = {}
                for seed in spec.seeds_of(v):
                    if v.run is None:
                        r = dict(ar)
                    else:
                        d = load_variant(v, trained[(v.run, seed)], target, cache)
                        r = evaluate(target, d, prompts, max_new, temp, progress=progress, keep_ids=checked,
                                     sampler=spec.sampler)
                    r["speedup"] = _s_per_token(ar) / _s_per_token(r)
                    r["tok_s"] = 1.0 / _s_per_token(r)
                    if checked:  # lossless: every prompt's output equals the target's own
                        r["lossless"] = len(prompts) - len(differing_prompts(r, ar))
                    r["n_prompts"] = len(prompts)
                    per_seed[str(seed)] = r
                cell[v.name] = per_seed
    return results


def head_overheads(spec: ExperimentSpec, trained: dict) -> dict:
    """Per domino variant (first seed): draft-step ms with the head on and off, measured on the side."""
    from ..target import Target
    from .timing import head_overhead_ms

    out, cache, target = {}, {}, None
    for v in spec.variants:
        if v.run is None or not v.head:
            continue
        run = trained[(v.run, spec.seeds_of(v)[0])]
        target = target or Target.from_pretrained(run.config.get("target", "default"))
        d = load_variant(v, run, target, cache)
        if d.has_head:
            out[v.name] = head_overhead_ms(d)
    return out
