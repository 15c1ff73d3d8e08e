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


def head_overhead_ms(d, ctx: int = 128, reps: int = 20, rounds: int = 3) -> dict:
    """Median thread-CPU ms of one draft step with the Domino head on and off (same weights, interleaved rounds)."""
    step = cached_step(d, ctx, torch.Generator().manual_seed(0))
    was = d.head_enabled
    times = {True: [], False: []}
    try:
        for on in (True, False):      # warm-up (builds the fast head's input table)
            d.head_enabled = on
            step()
        for _ in range(rounds):
            for on in (True, False):
                d.head_enabled = on
                for _ in range(reps):
                    c0 = time.thread_time()
                    step()
                    times[on].append(time.thread_time() - c0)
    finally:
        d.head_enabled = was
    on, off = (1e3 * statistics.median(times[k]) for k in (True, False))
    return {"draft_ms_head_on": on, "draft_ms_head_off": off, "head_ms": on - off, "head_ratio": on / off}
