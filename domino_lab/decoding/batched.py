"""Batched greedy speculative decoding: several sequences per target forward, with ragged acceptance.

Every row drafts a block and the whole batch is verified in one target forward. Rows accept different
numbers of drafts, so instead of cropping per row (a cache has one length) the rejected slots stay in
the caches as *holes*: an attention mask hides them from every later query, and explicit position ids
give each row its own positions. Slots rejected by every row are cropped, and rows that finish leave the batch.
How many drafts a step verifies is the adaptive count of decoding/adaptive.py by default
(docs/design.md#adaptive-batched-drafts). `drafter=None` is batched plain decoding through the same code. Greedy,
or sampled with the gumbel sampler (docs/design.md#gumbel-coupled-sampling), which verifies by the greedy rule: each
row's output equals its own decoding, token for token, either way.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .. import sampling
from ..errors import UserError
from ..validation import check_seed, check_token_ids
from ..models.options import BATCH_DRAFTS
from .adaptive import DraftCount
from .kv_cache import new_cache
from .lookup import copy_index, copy_inputs, draft_lookup


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


def check_batched_mode(drafter, temperature: float, top_p: float = 1.0, sampler: str = "rejection") -> None:
    """What batched decoding cannot do, one error each: rejection sampling at T > 0 (it is decoded one sequence at a
    time), or a drafter whose caches cannot hold ragged rows. Callers that start work first (a Lightning run) check
    with it up front."""
    sampling.check_sampling(temperature, top_p, sampler)
    if temperature > 0 and sampler != "gumbel":
        raise UserError("batched decoding samples with the gumbel sampler only (rejection sampling is decoded one "
                        "sequence at a time): pass sampler='gumbel' or temperature 0")
    if drafter is not None and not drafter.supports_batched:
        raise UserError(f"batched decoding does not support the '{drafter.config.method}' drafter (its caches "
                        "cannot hold ragged rows); decode it one sequence at a time (speculative_generate)")


@torch.no_grad()
def batched_generate(target, drafter, prompts_ids: list[list[int]], max_new_tokens: int = 128,
                     drafts: str | int | None = None, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                     sampler: str = "rejection", row_seeds: list[int] | None = None) -> BatchResult:
    """Greedy decoding of every prompt, batched; each row's output equals its own greedy decoding.

    T > 0 samples with `sampler="gumbel"` only (rejection sampling is not batched): row r then emits exactly what
    `speculative_generate` emits for its prompt with seed `seed + r` (or `row_seeds[r]` when given) and the gumbel
    sampler, with or without a drafter.

    drafts: how many drafts each step verifies, "all" (the drafter's whole block), "adaptive" (the count that
    maximises measured tokens per second, decoding/adaptive.py; 0 = a plain step) or a whole number 0..the drafter's
    drafts (that many every step: what the adaptive count is measured against, experiments/batch_drafts.py); None =
    the drafter's `batch_drafts` inference option. Rows that finish leave the batch, so they cost nothing
    afterwards."""
    if not prompts_ids or any(len(p) == 0 for p in prompts_ids):
        raise UserError("every prompt of the batch needs at least one token")
    prompts_ids = [check_token_ids(p, target.vocab_size, f"prompt {i}") for i, p in enumerate(prompts_ids)]
    if max_new_tokens < 1:
        raise UserError("max_new_tokens must be >= 1")
    if drafts is None:
        drafts = drafter.options.batch_drafts if drafter is not None else "all"
    fixed = None                                   # a fixed draft count, when `drafts` is a number
    if isinstance(drafts, int) and not isinstance(drafts, bool):
        most = drafter.config.num_drafts if drafter is not None else 0
        if not 0 <= drafts <= most:
            raise UserError(f"a fixed draft count must be a whole number from 0 to the drafter's {most} drafts, got "
                            f"{drafts}")
        fixed = drafts
    elif drafts not in BATCH_DRAFTS:
        raise UserError(f"unknown batch drafts policy {drafts!r}; use one of {list(BATCH_DRAFTS)} or a draft count")
    check_batched_mode(drafter, temperature, top_p, sampler)
    if row_seeds is None:
        row_seeds = [seed + r for r in range(len(prompts_ids))]
    if len(row_seeds) != len(prompts_ids):
        raise UserError(f"row_seeds has {len(row_seeds)} seeds for {len(prompts_ids)} prompts; give one per prompt")
    for row_seed in row_seeds:
        check_seed(row_seed)
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
    taps = drafter.config.target_layer_ids if drafter is not None else None
    n_drafts = drafter.config.num_drafts if drafter is not None else 0
    min_copy = drafter.options.lookup if drafter is not None else 0
    ar = torch.arange(width, device=dev)
    # one noise source per prompt (its seed and positions): a row's tokens are its own Gumbel-max draws
    noise = [sampling.GumbelNoise(row_seeds[r], target.vocab_size, temperature, dev) for r in range(b)] \
        if temperature > 0 else None

    def choose(logits: torch.Tensor, rows: list[int], first: torch.Tensor) -> torch.Tensor:
        """The target's token at k positions of each row: logits [rows, k, V], the first position [rows]."""
        k = logits.shape[1]
        g = torch.stack([noise[r].rows(range(int(f), int(f) + k)) for r, f in zip(rows, first)])
        return sampling.gumbel_choice(logits.flatten(0, 1), g.flatten(0, 1), temperature, top_p).view(len(rows), k)

    t_start = time.perf_counter()
    # left padding: every row's last prompt token sits in the last column
    ids = torch.zeros(b, width, dtype=torch.long, device=dev)
    valid = ar[None] >= (width - lens)[:, None]                       # [b, slots] True = a real token
    for r, p in enumerate(prompts_ids):
        ids[r, width - len(p):] = torch.tensor(p, device=dev)
    pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
    # no capacity hint: rejected slots that some row keeps stay as holes, so a batch's final cache length is not
    # known (buffers sized for the no-hole case decoded no faster)
    cache = new_cache(target.model.config)
    out = target.forward(ids, cache=cache, taps=taps, attention_mask=valid.long(), position_ids=pos,
                         last_logits_only=True, greedy=noise is None)
    anchor = out.tokens[:, -1] if noise is None else choose(out.logits[:, -1:], list(range(b)), lens)[:, 0]
    tokens = [[int(t)] for t in anchor]
    done = [tokens[r][-1] in eos or len(tokens[r]) >= budget[r] for r in range(b)]
    reasons = ["eos" if tokens[r][-1] in eos else full[r] for r in range(b)]
    # lookup drafting per row: a row whose text repeats verifies the copy instead of its drafts (the batch's draft
    # forward still runs for the other rows, unless every row copies)
    lookups = [draft_lookup(min_copy, p + t) for p, t in zip(prompts_ids, tokens)] if min_copy else None
    copied = [False] * b
    copy_k = drafter.config.copy_ngram if drafter is not None else 0      # the drafter's copy input, per row
    copiers = [copy_index(copy_k) for _ in prompts_ids] if copy_k else None   # (caught up when a draft reads them)
    start = lens.clone()                                              # position of each row's anchor
    # target features not yet in the draft cache, as chunks (features [b, C, kH], validity and positions [b, C];
    # left pads get negative positions, masked anyway), one per step since the last draft, joined when one runs
    pending = [(out.features, valid, ar[None] - (width - lens)[:, None])] if taps is not None else []
    draft_cache = new_cache() if drafter is not None else None
    draft_valid = torch.zeros(b, 0, dtype=torch.bool, device=dev)
    lengths: list[list[int]] = [[] for _ in range(b)]
    steps, t_draft, t_verify = 0, 0.0, 0.0
    policy = DraftCount(n_drafts) if drafts == "adaptive" and n_drafts else None
    # live[i] = the prompt index of batch row i; a row that finishes is dropped from every per-row tensor and
    # cache, so a long-running row does not drag the finished ones through its remaining steps
    live = list(range(b))

    while True:
        rows = [i for i, r in enumerate(live) if not done[r]]
        if len(rows) < len(live):                                     # drop the rows that finished
            live = [live[i] for i in rows]
            if not live:
                break
            sel = torch.tensor(rows, device=dev)
            cache.batch_select_indices(sel)
            valid, anchor, start = valid[sel], anchor[sel], start[sel]
            if draft_cache is not None:
                draft_cache.batch_select_indices(sel)
                draft_valid = draft_valid[sel]
            pending = [tuple(x[sel] for x in chunk) for chunk in pending]
        room = max(budget[r] - len(tokens[r]) for r in live) - 1     # the bonus token takes the last slot
        n = min(n_drafts if fixed is None else fixed, room)
        taken = sum(c[0].shape[1] for c in pending)                  # context positions the next draft takes in
        copies = [lookups[r].offer(n) for r in live] if lookups is not None and n > 0 else None
        # every row repeats itself: verify the copies and leave the drafter out (its context waits)
        copy_only = copies is not None and all(copies)
        if policy is not None and not copy_only:
            n = policy.choose(len(live), n, taken)
        t0 = time.perf_counter()
        if copy_only:
            drafted = torch.tensor(copies, device=dev)
        elif n > 0:
            block = torch.ones(len(live), drafter.config.block_size, dtype=torch.bool, device=dev)
            feats, feats_valid, feats_pos = (torch.cat(x, dim=1) for x in zip(*pending))
            key_valid = torch.cat([draft_valid, feats_valid, block], dim=1)
            cands = None
            if copiers is not None:
                for r in live:
                    copiers[r].catch_up(prompts_ids[r], tokens[r])
                cands = copy_inputs([copiers[r] for r in live], n_drafts, dev)
            g = None if noise is None else torch.stack(
                [noise[r].rows(range(int(s) + 1, int(s) + 1 + n_drafts)) for r, s in zip(live, start)])
            drafted = drafter.draft(feats, feats_pos, anchor, start, draft_cache, n=n, key_valid=key_valid,
                                    copy=cands, noise=g).tokens
            draft_valid = torch.cat([draft_valid, feats_valid], dim=1)
            pending = []
            for i, copy in enumerate(copies or []):
                if copy:
                    drafted[i] = torch.tensor(copy[:n], device=dev)
        else:
            drafted = torch.empty(len(live), 0, dtype=torch.long, device=dev)
        for i, r in enumerate(live):
            copied[r] = bool(copies and copies[i]) and drafted.shape[1] > 0
        t1 = time.perf_counter()
        k = drafted.shape[1] + 1
        verify_ids = torch.cat([anchor[:, None], drafted], dim=1)
        vpos = start[:, None] + torch.arange(k, device=dev)
        valid = torch.cat([valid, torch.ones(len(live), k, dtype=torch.bool, device=dev)], dim=1)
        out = target.forward(verify_ids, cache=cache, taps=taps, attention_mask=valid.long(), position_ids=vpos,
                             greedy=noise is None)
        best = out.tokens if noise is None else choose(out.logits, live, start + 1)
        acc, nxt = sampling.greedy_accept(drafted, best)
        t2 = time.perf_counter()
        steps += 1
        t_draft, t_verify = t_draft + t1 - t0, t_verify + t2 - t1
        if policy is not None:
            # the drafter's acceptance from the rows it drafted for (copied rows accept by other rules)
            by_drafter = None if copy_only or not n else [int(a) for i, a in enumerate(acc) if not copied[live[i]]]
            policy.update(drafted.shape[1], len(live), t2 - t1, by_drafter, t1 - t0, taken)

        keep = acc + 1
        for i, r in enumerate(live):
            committed, _, _ = sampling.commit(drafted[i, : int(acc[i])].tolist(), int(nxt[i]), eos,
                                              budget[r] - len(tokens[r]))
            tokens[r].extend(committed)
            lengths[r].append(len(committed))
            if lookups is not None:
                lookups[r].update(committed, int(acc[i]), drafted.shape[1], copied[r])
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
            pending.append((out.features[:, :m], new_valid[:, :m], vpos[:, :m]))
        anchor = torch.tensor([tokens[r][-1] for r in live], device=dev)
        start = start + keep
        if noise is not None:
            for r, s in zip(live, start.tolist()):
                noise[r].forget(s + 1)
    wall = time.perf_counter() - t_start
    return BatchResult([t for t in tokens], lengths, steps, wall, t_draft, t_verify, reasons)
