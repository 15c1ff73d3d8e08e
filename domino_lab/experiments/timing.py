"""Draft-step timing outside a decode: the same cached state every call, so variants compare on equal terms."""
from __future__ import annotations

import statistics
import time

import torch


def _cached_state(d, ctx: int, g: torch.Generator, new: int):
    """Random target features, anchor and ids of a `ctx`-position context, the first ctx - new already in a fresh
    draft cache (as after a step that accepted new - 1 drafts)."""
    from ..decoding.kv_cache import new_cache

    cfg = d.config
    feats = torch.randn(1, ctx, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g).to(d.target.dtype)
    anchor = torch.randint(0, cfg.vocab_size - 1, (1,), generator=g)
    ids = torch.randint(0, cfg.vocab_size - 1, (1, ctx), generator=g)
    cache = new_cache()
    d.draft(feats[:, : ctx - new], 0, anchor, ctx - new, cache, ctx_ids=ids[:, : ctx - new])
    return feats, anchor, ids, cache


def cached_step(d, ctx: int, g: torch.Generator, new: int = 2, copy: bool = False):
    """A decoding-like draft step: `ctx` positions already in the draft cache, `new` committed positions' features
    appended (as after a step that accepted new-1 drafts), then removed again so every call sees the same state.
    `copy`: a drafter with a copy input reads the copy candidates of the context's ids, as decoding gives it."""
    feats, anchor, ids, cache = _cached_state(d, ctx, g, new)
    cands = None
    if copy and d.config.copy_ngram:
        from ..decoding.lookup import copy_index, copy_inputs

        cands = copy_inputs([copy_index(d.config.copy_ngram, ids[0].tolist() + anchor.tolist())], d.config.num_drafts)

    def step():
        d.draft(feats[:, ctx - new:], ctx - new, anchor, ctx, cache, ctx_ids=ids[:, ctx - new:], copy=cands)
        cache.crop(-new)
    return step


def cached_tree_step(d, ctx: int, g: torch.Generator, nodes: int, new: int = 2, topk: int = 5):
    """`cached_step` for tree drafting: the backbone pass over the same cached state, then the best-first tree of
    `nodes` nodes over the block's depth (the Domino head stepping along every kept branch). step() returns the
    tree, so a verify timing can use its shape."""
    from ..decoding.tree import build_tree

    feats, anchor, ids, cache = _cached_state(d, ctx, g, new)

    def step():
        expander = d.tree_expander(feats[:, ctx - new:], ctx - new, anchor, ctx, cache, n=d.config.num_drafts,
                                   topk=topk)
        tree = build_tree(expander, nodes, d.config.num_drafts, topk)
        cache.crop(-new)
        return tree
    return step


def interleaved_ms(step, variants, set_variant, reps: int = 20, rounds: int = 3) -> dict:
    """Median thread-CPU and wall ms of `step()` under each variant: one warm-up call each, then `rounds` rounds of
    `reps` calls per variant, interleaved so every variant sees the same machine state. Thread CPU time is robust
    to other processes sharing the cores."""
    cpu = {v: [] for v in variants}
    wall = {v: [] for v in variants}
    for v in variants:            # warm-up (builds the fast head's input table, the fused kernel)
        set_variant(v)
        step()
    for _ in range(rounds):
        for v in variants:
            set_variant(v)
            for _ in range(reps):
                t0, c0 = time.perf_counter(), time.thread_time()
                step()
                cpu[v].append(time.thread_time() - c0)
                wall[v].append(time.perf_counter() - t0)
    return {v: {"cpu_ms": 1e3 * statistics.median(cpu[v]), "wall_ms": 1e3 * statistics.median(wall[v])}
            for v in variants}


def head_overhead_ms(d, ctx: int = 128, reps: int = 20, rounds: int = 3) -> dict:
    """Median thread-CPU ms of one draft step with the Domino head on and off (same weights, interleaved rounds)."""
    step = cached_step(d, ctx, torch.Generator().manual_seed(0))
    was = d.head_enabled
    try:
        ms = interleaved_ms(step, (True, False), lambda on: setattr(d, "head_enabled", on), reps, rounds)
    finally:
        d.head_enabled = was
    on, off = ms[True]["cpu_ms"], ms[False]["cpu_ms"]
    return {"draft_ms_head_on": on, "draft_ms_head_off": off, "head_ms": on - off, "head_ratio": on / off}


def step_costs(target, d, ctx: int = 128, reps: int = 10, rounds: int = 3) -> dict:
    """What one decoding step of drafter `d` costs on `target`, by part, measured the way a decode meets them.

    Each rep runs a draft step (`cached_step`), a verify forward of the anchor and the drafter's drafts (taps on,
    greedy tokens) and a plain one-token forward on a `ctx`-token target cache, in turn: every draft then follows a
    target forward that has pushed the drafter's weights out of the cache, as in a real decode (a warm loop of
    drafts alone runs the drafter's matmuls ~3x faster). Medians over `rounds` x `reps`, at decoding's thread
    count; thread CPU time at one thread (other processes on the cores, e.g. more sweep workers, do not count),
    wall time otherwise. A decode's own per-step times come from one text and swing by ±20% from one call to the
    next on a shared CPU; these are what compares drafters measured at different times (the sweep's trials).

    Returns {"draft_ms", "verify_ms", "step_ms", "threads"}: speedup_bound(τ, step_ms, draft_ms, verify_ms) is the
    cost model's speedup at acceptance τ."""
    from ..decoding.kv_cache import new_cache, record_past
    from ..target import decode_threads, torch_threads

    g = torch.Generator().manual_seed(0)
    taps = list(d.config.target_layer_ids)
    k = d.config.num_drafts + 1
    dev = target.device
    with torch_threads(decode_threads(target)) as threads, torch.no_grad():
        cache = new_cache(target.model.config)
        target.forward(torch.randint(0, target.vocab_size, (1, ctx), generator=g).to(dev), cache=cache, taps=taps,
                       last_logits_only=True)
        record_past(cache, k)               # as decoding does: linear-attention layers are cut back from the record

        def forward(n: int, with_taps: bool):
            ids = torch.randint(0, target.vocab_size, (1, n), generator=g).to(dev)

            def run():
                target.forward(ids, cache=cache, taps=taps if with_taps else None, greedy=True)
                cache.crop(-n)
            return run

        parts = {"draft": cached_step(d, ctx, g), "verify": forward(k, True), "step": forward(1, False)}
        clock = time.thread_time if threads == 1 else time.perf_counter
        times: dict = {name: [] for name in parts}
        for f in parts.values():              # warm-up: allocator, the fused head's kernel and tables
            f()
        for _ in range(rounds * reps):
            for name, f in parts.items():
                t0 = clock()
                f()
                times[name].append(clock() - t0)
    return {f"{name}_ms": 1e3 * statistics.median(v) for name, v in times.items()} | {"threads": threads}
