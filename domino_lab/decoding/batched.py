"""Batched greedy speculative decoding: several sequences per target forward, with ragged acceptance.

Every row drafts a block and the whole batch is verified in one target forward. Rows accept different
numbers of drafts, so instead of cropping per row (a cache has one length) the rejected slots stay in
the caches as *holes*: an attention mask hides them from every later query, and explicit position ids
give each row its own positions. Slots rejected by every row are cropped. `drafter=None` is batched
plain decoding through the same code. Greedy only: each row's output equals its own greedy decoding.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from .. import sampling
from ..errors import UserError
from .lookup import NgramLookup


@dataclass
class BatchResult:
    token_ids: list[list[int]]
    acceptance_lengths: list[list[int]]          # per row, per verify step in which the row was active
    steps: int                                   # verify forwards of the batch
    wall_time_s: float
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    stop_reasons: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return sum(map(len, self.token_ids)) / self.wall_time_s if self.wall_time_s > 0 else 0.0


@torch.no_grad()
def batched_generate(target, drafter, prompts_ids: list[list[int]], max_new_tokens: int = 128) -> BatchResult:
    if not prompts_ids or any(len(p) == 0 for p in prompts_ids):
        raise UserError("every prompt of the batch needs at least one token")
    if max_new_tokens < 1:
        raise UserError("max_new_tokens must be >= 1")
    dev, b = target.device, len(prompts_ids)
    lens = torch.tensor([len(p) for p in prompts_ids], device=dev)
    width = int(lens.max())
    if width >= target.max_length:
        raise UserError(f"a prompt has {width} tokens but the target's context is {target.max_length}")
    budget = [min(max_new_tokens, target.max_length - len(p)) for p in prompts_ids]
    # why a row that used its whole budget stopped: the request, or the target's context (the smaller of the two)
    full = ["context_length" if target.max_length - len(p) < max_new_tokens else "max_new_tokens"
            for p in prompts_ids]
    eos = target.eos_token_ids
    if drafter is not None and not drafter.supports_batched:
        raise UserError(f"batched decoding does not support the '{drafter.config.method}' drafter (its caches "
                        "cannot hold ragged rows); decode it one sequence at a time (speculative_generate)")
    taps = drafter.config.target_layer_ids if drafter is not None else None
    n_drafts = drafter.config.num_drafts if drafter is not None else 0
    min_copy = drafter.options.lookup if drafter is not None else 0
    ar = torch.arange(width, device=dev)

    t_start = time.perf_counter()
    # left padding: every row's last prompt token sits in the last column
    ids = torch.zeros(b, width, dtype=torch.long, device=dev)
    valid = ar[None] >= (width - lens)[:, None]                       # [b, slots] True = a real token
    for r, p in enumerate(prompts_ids):
        ids[r, width - len(p):] = torch.tensor(p, device=dev)
    pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=target.model.config)
    out = target.forward(ids, cache=cache, taps=taps, attention_mask=valid.long(), position_ids=pos)
    anchor = out.logits[:, -1].argmax(-1)
    tokens = [[int(t)] for t in anchor]
    done = [tokens[r][-1] in eos or len(tokens[r]) >= budget[r] for r in range(b)]
    reasons = ["eos" if tokens[r][-1] in eos else full[r] for r in range(b)]
    # lookup drafting per row: a row whose text repeats verifies the copy instead of its drafts (the batch's draft
    # forward still runs, since the other rows share it)
    lookups = [NgramLookup(min_copy, p + t) for p, t in zip(prompts_ids, tokens)] if min_copy else None
    copied = [False] * b
    start = lens.clone()                                              # position of each row's anchor
    # target features not yet in the draft cache: [b, C, kH], their validity and positions [b, C]
    # (left pads get negative positions; they are masked anyway)
    pending, pending_valid, pending_pos = out.features, valid, ar[None] - (width - lens)[:, None]
    draft_cache = DynamicCache() if drafter is not None else None
    draft_valid = torch.zeros(b, 0, dtype=torch.bool, device=dev)
    lengths: list[list[int]] = [[] for _ in range(b)]
    steps, t_draft, t_verify = 0, 0.0, 0.0

    while not all(done):
        remaining = max(budget[r] - len(tokens[r]) for r in range(b) if not done[r])
        n = min(n_drafts, remaining - 1)
        t0 = time.perf_counter()
        if n > 0:
            block = torch.ones(b, drafter.config.block_size, dtype=torch.bool, device=dev)
            key_valid = torch.cat([draft_valid, pending_valid, block], dim=1)
            drafts = drafter.draft(pending, pending_pos, anchor, start, draft_cache, n=n,
                                   key_valid=key_valid).tokens
            draft_valid = torch.cat([draft_valid, pending_valid], dim=1)
            pending = None
            if lookups is not None:
                for r in range(b):
                    copy = [] if done[r] else lookups[r].propose(n)[0]
                    copied[r] = bool(copy)
                    if copy:
                        drafts[r] = torch.tensor(copy, device=dev)
        else:
            drafts = torch.empty(b, 0, dtype=torch.long, device=dev)
        t1 = time.perf_counter()
        k = drafts.shape[1] + 1
        verify_ids = torch.cat([anchor[:, None], drafts], dim=1)
        vpos = start[:, None] + torch.arange(k, device=dev)
        valid = torch.cat([valid, torch.ones(b, k, dtype=torch.bool, device=dev)], dim=1)
        out = target.forward(verify_ids, cache=cache, taps=taps, attention_mask=valid.long(), position_ids=vpos)
        acc, nxt = sampling.greedy_accept(drafts, out.logits)
        t2 = time.perf_counter()
        steps += 1
        t_draft, t_verify = t_draft + t1 - t0, t_verify + t2 - t1

        keep = acc + 1
        for r in range(b):
            if done[r]:
                keep[r] = 0
                continue
            committed, _, _ = sampling.commit(drafts[r, : int(acc[r])].tolist(), int(nxt[r]), eos,
                                              budget[r] - len(tokens[r]))
            tokens[r].extend(committed)
            lengths[r].append(len(committed))
            if lookups is not None:
                lookups[r].update(committed, int(acc[r]), drafts.shape[1], copied[r])
            if tokens[r][-1] in eos or len(tokens[r]) >= budget[r]:
                done[r] = True
                reasons[r] = "eos" if tokens[r][-1] in eos else full[r]
        # the new slots a row keeps are its anchor and accepted drafts; the rest become holes
        new_valid = torch.arange(k, device=dev)[None] < keep[:, None]
        valid[:, -k:] = new_valid
        cut = k - int(keep.max())
        if cut > 0:                                                   # rejected by every row: crop
            cache.crop(-cut)
            valid = valid[:, :-cut]
        m = k - cut
        if taps is not None:
            if pending is None:
                pending, pending_valid, pending_pos = out.features[:, :m], new_valid[:, :m], vpos[:, :m]
            else:   # no draft consumed the last features (a round without drafts): keep both, in order
                pending = torch.cat([pending, out.features[:, :m]], dim=1)
                pending_valid = torch.cat([pending_valid, new_valid[:, :m]], dim=1)
                pending_pos = torch.cat([pending_pos, vpos[:, :m]], dim=1)
        anchor = torch.tensor([tokens[r][-1] for r in range(b)], device=dev)
        start = start + keep
    wall = time.perf_counter() - t_start
    return BatchResult([t for t in tokens], lengths, steps, wall, t_draft, t_verify, reasons)
