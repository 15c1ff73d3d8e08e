"""Draft-step timing outside a decode: the same cached state every call, so variants compare on equal terms."""
from __future__ import annotations

import statistics
import time

import torch


def cached_step(d, ctx: int, g: torch.Generator, new: int = 2):
    """A decoding-like draft step: `ctx` positions already in the draft cache, `new` committed positions' features
    appended (as after a step that accepted new-1 drafts), then removed again so every call sees the same state."""
    from transformers import DynamicCache

    cfg = d.config
    feats = torch.randn(1, ctx, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g).to(d.target.dtype)
    anchor = torch.randint(0, cfg.vocab_size - 1, (1,), generator=g)
    ids = torch.randint(0, cfg.vocab_size - 1, (1, ctx), generator=g)
    cache = DynamicCache()
    d.draft(feats[:, : ctx - new], 0, anchor, ctx - new, cache, ctx_ids=ids[:, : ctx - new])

    def step():
        d.draft(feats[:, ctx - new:], ctx - new, anchor, ctx, cache, ctx_ids=ids[:, ctx - new:])
        cache.crop(-new)
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
