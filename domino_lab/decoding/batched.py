"""Batched greedy speculative decoding: several sequences per target forward, with ragged acceptance.

Every row drafts a block and the whole batch is verified in one target forward. Rows accept different
numbers of drafts, so instead of cropping per row (a cache has one length) the rejected slots stay in
the caches as *holes*: an attention mask hides them from every later query, and explicit position ids
give each row its own positions. Slots rejected by every row are cropped, and rows that finish leave the batch;
with fewer `slots` than prompts the prompts queue, and a finished row's place goes to the next one (continuous
batching: its prompt is prefilled and written into that row of the caches, docs/design.md#continuous-batching).
Prompts that enter together are prefilled in groups of similar length, not padded to the longest.
How many drafts a step verifies is the adaptive count of decoding/adaptive.py by default
(docs/design.md#adaptive-batched-drafts). `drafter=None` is batched plain decoding through the same code. Greedy,
or sampled with the gumbel sampler (docs/design.md#gumbel-coupled-sampling), which verifies by the greedy rule: each
row's output equals its own decoding, token for token, either way.
"""
from __future__ import annotations

import numbers
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .. import sampling
from ..errors import UserError
from ..validation import check_drafter, check_int, check_seed, check_token_ids, fresh_seed
from ..models.options import BATCH_DRAFTS
from .adaptive import DraftCount
from .kv_cache import (attends, check_layers, check_positions, check_recording, cut_back_rows, drop_outside_windows,
                       layer_masks, new_cache, place_rows, record_past, select_rows, stack_rows, trim_left,
                       window_layout, window_offset)
from .lookup import copy_index, copy_inputs, draft_lookup

PREFILL_SLACK = 1.25   # prompts prefilled in one forward: at most this many padded positions per real one
TRIM_COLUMNS = 64      # leading cache columns no live row attends to, trimmed once at least this many (each trim copies
                       # the cache, so not every step)


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


def check_batched_mode(drafter, temperature: float, top_p: float = 1.0, sampler: str = "rejection",
                       target=None) -> None:
    """What batched decoding cannot do, one error each: rejection sampling at T > 0 (it is decoded one sequence at a
    time), a drafter whose caches cannot hold ragged rows, a target whose layers batches cannot handle
    (kv_cache.check_layers; the drafter's target unless `target` is given), or drafts for a target that does not read
    the positions it is given (kv_cache.check_positions: rejected drafts leave holes; without drafts a row's tokens
    sit in consecutive columns, and plain batches decode such a target exactly). Callers that start work first (a
    Lightning run) check with it up front."""
    sampling.check_sampling(temperature, top_p, sampler)
    if temperature > 0 and sampler != "gumbel":
        raise UserError("batched decoding samples with the gumbel sampler only (rejection sampling is decoded one "
                        "sequence at a time): pass sampler='gumbel' or temperature 0")
    if drafter is not None and not drafter.supports_batched:
        raise UserError(f"batched decoding does not support the '{drafter.config.method}' drafter (its caches "
                        "cannot hold ragged rows); decode it one sequence at a time (speculative_generate)")
    if drafter is not None and drafter.options.block_size is not None:
        raise UserError("batched decoding drafts the drafter's whole block and chooses each step's draft count with "
                        "its batch-drafts policy; a block size is an option of one-sequence decoding: drop it "
                        "(--block-size, block_size=None) or decode one sequence at a time (without --batched)")
    target = target if target is not None else drafter.target if drafter is not None else None
    if target is not None:
        check_layers(target.model.config, "batched decoding", rows=True)
        check_recording(target, "batched decoding")
        if drafter is not None:
            check_positions(target, "batched speculative decoding",
                            "decode it one sequence at a time (without --batched), or batched without a drafter")


def check_slots(slots: int | None) -> int | None:
    """The rows a queue decodes at once (None = every prompt at once), or one error."""
    return None if slots is None else check_int(slots, "slots", 1, what=" (the rows decoded at once)")


def compact(feats: torch.Tensor, valid: torch.Tensor, pos: torch.Tensor) -> tuple:
    """Context waiting for the draft cache, features [rows, C, kH] with validity and positions [rows, C], with each
    row's valid positions moved to the right end in order and the columns no row needs dropped. A draft after plain
    steps takes in chunks in which most rows hold nothing (a prompt that joined, holes of rejected drafts): 803
    columns of which each of 16 rows needed at most ~250, each taken in by every row and then attended to by every
    later draft. The draft cache does not need its columns aligned across rows (each row has its own positions and
    validity)."""
    keep = int(valid.sum(1).max())
    if keep == valid.shape[1]:
        return feats, valid, pos
    idx = torch.sort(valid.to(torch.uint8), dim=1, stable=True).indices[:, valid.shape[1] - keep:]
    return feats.gather(1, idx[..., None].expand(-1, -1, feats.shape[-1])), valid.gather(1, idx), pos.gather(1, idx)


@torch.no_grad()
def batched_generate(target, drafter, prompts_ids: list[list[int]], max_new_tokens: int = 128,
                     drafts: str | int | None = None, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = 0,
                     sampler: str = "rejection", row_seeds: list[int] | None = None,
                     slots: int | None = None) -> BatchResult:
    """Greedy decoding of every prompt, batched; each row's output equals its own greedy decoding.

    T > 0 samples with `sampler="gumbel"` only (rejection sampling is not batched): row r then emits exactly what
    `speculative_generate` emits for its prompt with seed `seed + r` (or `row_seeds[r]` when given; seed None: a fresh one) and the gumbel
    sampler, with or without a drafter.

    drafts: how many drafts each step verifies, "all" (the drafter's whole block), "adaptive" (the count that
    maximises measured tokens per second, decoding/adaptive.py; 0 = a plain step) or a whole number 0..the drafter's
    drafts (that many every step: what the adaptive count is measured against, experiments/batch_drafts.py); None =
    the drafter's `batch_drafts` inference option. Rows that finish leave the batch, so they cost nothing
    afterwards.

    slots: at most this many rows decode at once, and a row that finishes hands its slot to the next waiting prompt
    (continuous batching: a batch's speed then follows its rows' mean acceptance rather than its slowest row's);
    None = every prompt at once. Each prompt's output does not depend on it."""
    check_drafter(drafter, target)
    if hasattr(prompts_ids, "tolist"):             # a 2D tensor or array: one row per prompt
        prompts_ids = prompts_ids.tolist()
    elif not isinstance(prompts_ids, (str, bytes)) and hasattr(prompts_ids, "__iter__"):
        prompts_ids = list(prompts_ids)            # (a generator is read once)
    if isinstance(prompts_ids, str) or not prompts_ids or not all(
            isinstance(p, (list, tuple)) or hasattr(p, "tolist") for p in prompts_ids):
        raise UserError("prompts_ids must be a list with one list of token ids per prompt")
    if any(len(p) == 0 for p in prompts_ids):
        raise UserError("every prompt of the batch needs at least one token")
    prompts_ids = [check_token_ids(p, target.vocab_size, f"prompt {i}") for i, p in enumerate(prompts_ids)]
    max_new_tokens = check_int(max_new_tokens, "max_new_tokens", 1)
    if drafts is None:
        drafts = drafter.options.batch_drafts if drafter is not None else "all"
    fixed = None                                   # a fixed draft count, when `drafts` is a number
    if isinstance(drafts, numbers.Integral) and not isinstance(drafts, bool):
        drafts = int(drafts)
        most = drafter.config.num_drafts if drafter is not None else 0
        if not 0 <= drafts <= most:
            raise UserError(f"a fixed draft count must be a whole number from 0 to the drafter's {most} drafts, got "
                            f"{drafts}")
        fixed = drafts
    elif drafts not in BATCH_DRAFTS:
        raise UserError(f"unknown batch drafts policy {drafts!r}; use one of {list(BATCH_DRAFTS)} or a draft count")
    check_batched_mode(drafter, temperature, top_p, sampler, target)
    if row_seeds is None:
        seed = check_seed(seed if seed is not None else fresh_seed())
        row_seeds = [seed + r for r in range(len(prompts_ids))]
    if len(row_seeds) != len(prompts_ids):
        raise UserError(f"row_seeds has {len(row_seeds)} seeds for {len(prompts_ids)} prompts; give one per prompt")
    for row_seed in row_seeds:
        check_seed(row_seed)
    dev, b = target.device, len(prompts_ids)
    slots = check_slots(slots)
    slots = b if slots is None else slots
    width = max(map(len, prompts_ids))
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
    copy_k = drafter.config.copy_ngram if drafter is not None else 0      # the drafter's copy input, per row
    # one noise source per prompt (its seed and positions): a row's tokens are its own Gumbel-max draws
    noise = [sampling.GumbelNoise(row_seeds[r], target.vocab_size, temperature, dev) for r in range(b)] \
        if temperature > 0 else None

    def choose(logits: torch.Tensor, rows: list[int], first: torch.Tensor) -> torch.Tensor:
        """The target's token at k positions of each row: logits [rows, k, V], the first position [rows]."""
        k = logits.shape[1]
        g = torch.stack([noise[r].rows(range(int(f), int(f) + k)) for r, f in zip(rows, first)])
        return sampling.gumbel_choice(logits.flatten(0, 1), g.flatten(0, 1), temperature, top_p).view(len(rows), k)

    # per prompt: its tokens so far, whether and why it stopped, its lookup drafting index (a row whose text repeats
    # verifies the copy instead of its drafts; the batch's draft forward still runs for the other rows, unless every
    # row copies) and the drafter's copy index (caught up when a draft reads it)
    tokens: list[list[int]] = [[] for _ in range(b)]
    done, reasons = [False] * b, [""] * b
    lookups = [None] * b if min_copy else None
    copied = [False] * b
    copiers = [None] * b if copy_k else None
    lengths: list[list[int]] = [[] for _ in range(b)]
    windows = window_layout(target.model.config) is not None
    # a model of linear-attention or Mamba layers only: some (Mamba, FalconMamba) apply a 2D mask to their inputs
    # untrimmed, which a verify's mask over every column would break
    attending = attends(target.model.config)

    def verify_mask(valid: torch.Tensor, vpos: torch.Tensor):
        """The verify forward's attention mask: the validity of every column (holes and pads hidden) for Hugging
        Face to build the causal mask from; with sliding windows, which Hugging Face would count in columns, a
        full mask whose windows are counted in token positions (docs/design.md#sliding-window-targets)."""
        if not attending:
            return None                 # (no attention layer, and a verify's tokens are never padding)
        if not windows:
            return valid.long()
        q = vpos.shape[1]
        cols = torch.arange(valid.shape[1], device=dev)
        seen = valid[:, None, :] & (cols[None, :] <= cols[-q:, None])[None]          # [rows, q, columns]
        mask = torch.zeros(seen.shape, dtype=target.dtype, device=dev)
        mask.masked_fill_(~seen, torch.finfo(target.dtype).min)
        return layer_masks(target.model.config, mask[:, None], vpos, valid.long().cumsum(-1) - 1,
                           dropped=window_offset(cache))


    def prefill_group(new: list[int]):
        """Run prompts `new` through the target (left padding: every row's last prompt token in the last column)
        and pick their first tokens. Returns their cache, validity [n, w] (True = a real token), first tokens,
        lengths and the target features the drafter has not taken in (features [n, w, kH], validity, positions;
        left pads get negative positions, masked anyway)."""
        lens = torch.tensor([len(prompts_ids[r]) for r in new], device=dev)
        w = int(lens.max())
        ar = torch.arange(w, device=dev)
        ids = torch.zeros(len(new), w, dtype=torch.long, device=dev)
        valid_new = ar[None] >= (w - lens)[:, None]
        for i, r in enumerate(new):
            ids[i, w - len(prompts_ids[r]):] = torch.tensor(prompts_ids[r], device=dev)
        pos = (valid_new.long().cumsum(-1) - 1).clamp(min=0)
        # no capacity hint: rejected slots that some row keeps stay as holes, so a batch's final cache length is not
        # known (buffers sized for the no-hole case decoded no faster)
        c = new_cache(target.model.config, batch_windows=True)
        out = target.forward(ids, cache=c, taps=taps, attention_mask=valid_new.long(), position_ids=pos,
                             last_logits_only=True, greedy=noise is None)
        first = out.tokens[:, -1] if noise is None else choose(out.logits[:, -1:], new, lens)[:, 0]
        for i, r in enumerate(new):
            tokens[r] = [int(first[i])]
            done[r] = tokens[r][-1] in eos or len(tokens[r]) >= budget[r]
            reasons[r] = "eos" if tokens[r][-1] in eos else full[r]
            if lookups is not None:
                lookups[r] = draft_lookup(min_copy, prompts_ids[r] + tokens[r])
            if copiers is not None:
                copiers[r] = copy_index(copy_k)
        chunk = (out.features, valid_new, ar[None] - (w - lens)[:, None]) if taps is not None else None
        return c, valid_new, first, lens, chunk

    def prefill(new: list[int]):
        """prefill_group over prompts of similar length at a time (one padded forward over prompts of 57 to 186 tokens
        did 1.6x the work), the groups' rows then stacked right-aligned. Returns the prompts in their new order and
        prefill_group's results for them."""
        order = sorted(new, key=lambda r: len(prompts_ids[r]))
        groups = [[order[0]]]
        for r in order[1:]:
            g = groups[-1]
            if len(prompts_ids[r]) * (len(g) + 1) <= PREFILL_SLACK * (sum(len(prompts_ids[q]) for q in g)
                                                                       + len(prompts_ids[r])):
                g.append(r)
            else:
                groups.append([r])
        parts = [prefill_group(g) for g in groups]
        if len(parts) == 1:
            return order, *parts[0]
        w = max(v.shape[1] for _, v, *_ in parts)
        left = [w - v.shape[1] for _, v, *_ in parts]
        valid_new = torch.cat([F.pad(v, (n, 0)) for n, (_, v, *_) in zip(left, parts)])
        first, lens = (torch.cat([p[i] for p in parts]) for i in (2, 3))
        chunk = None if parts[0][4] is None else (
            torch.cat([F.pad(f, (0, 0, n, 0)) for n, (*_, (f, _, _)) in zip(left, parts)]), valid_new,
            torch.cat([F.pad(q, (n, 0), value=-1) for n, (*_, (_, _, q)) in zip(left, parts)]))
        return order, stack_rows([p[0] for p in parts]), valid_new, first, lens, chunk

    def gather(chunks: list) -> tuple:
        """The pending chunks for the live rows, joined along the context and compacted: features [rows, C, kH],
        validity and positions [rows, C]. A chunk holds the rows that were live when it was made; rows that joined
        later take nothing from it (not valid)."""
        parts = []
        for rows_c, *xs in chunks:
            if rows_c == live:
                parts.append(xs)
                continue
            at = {r: i for i, r in enumerate(rows_c)}
            idx = torch.tensor([at.get(r, -1) for r in live], device=dev)
            f, v, p = (x[idx.clamp(min=0)] for x in xs)
            parts.append((f, v & (idx >= 0)[:, None], p))
        return compact(*(torch.cat(x, dim=1) for x in zip(*parts)))

    t_start = time.perf_counter()
    queue = list(range(b))                 # prompts waiting for a slot, in order
    # live[i] = the prompt index of batch row i; a row that finishes hands its place to the next waiting prompt or,
    # when none waits, is dropped from every per-row tensor and cache, so a long-running row does not drag the
    # finished ones through its remaining steps. Per row: `valid` [rows, columns] (False = a left pad or a hole), the anchor (its
    # last token) and its position `start`; `pending`: target features not yet in the draft cache, one chunk per
    # step since the last draft (with the rows it holds: rows come and go without copying them), gathered when one
    # runs; `draft_valid`: the draft cache's columns.
    live: list[int] = []
    cache = draft_cache = valid = anchor = start = draft_valid = None
    pending: list = []
    owed: dict[int, int] = {}              # per prompt, its valid positions in `pending`
    steps, t_draft, t_verify = 0, 0.0, 0.0
    t_joined = 0.0                         # draft time spent taking in joining prompts since the latest step
    # One row at a time (one prompt, or one slot) verifies the whole block every step, as batch-1 decoding does:
    # a verified position is nearly free there, and the count learns acceptance only while drafting, so a text
    # whose first tokens the drafter misses would stay on plain steps (docs/design.md#adaptive-batched-drafts).
    policy = DraftCount(n_drafts) if drafts == "adaptive" and n_drafts and min(b, slots) > 1 else None
    drafting = drafter is not None and fixed != 0      # whether the drafter ran in the latest step (copies aside)

    def still_needed(chunks: list) -> list:
        """The pending chunks that hold a live row (the others only held prompts that are done)."""
        alive = set(live)
        return [c for c in chunks if not alive.isdisjoint(c[0])]

    def trim() -> None:
        """Drop the leading cache columns that no live row attends to any more (those of rows that left), once there
        are enough of them to pay for the copy."""
        nonlocal valid, draft_valid
        valid = trim_left(cache, valid, TRIM_COLUMNS)
        if draft_valid.shape[1]:
            draft_valid = trim_left(draft_cache, draft_valid, TRIM_COLUMNS)

    def refill(slots_: list[int], new: list[int]) -> None:
        """Prompts `new` take over the batch rows `slots_` of finished ones: they are prefilled and written into
        those rows of the caches, right-aligned (the rows' older columns masked), so the rest of the batch is not
        copied."""
        nonlocal valid, draft_valid, t_draft, t_joined
        new, c, v, first, lens, chunk = prefill(new)
        idx = torch.tensor(slots_, device=dev)
        valid = place_rows(cache, valid, c, v, idx)
        anchor[idx], start[idx] = first, lens
        for i, r in zip(slots_, new):
            live[i] = r
        if drafter is None:
            return
        if drafting and draft_valid.shape[1] and not drafter.config.anchor_feature:
            # while the batch drafts, the new prompts enter the draft cache by themselves now: left pending, the
            # next draft would take them in padded to every row of the batch (a drafter that reads the feature
            # before its anchor in the draft's own context waits for the next draft instead)
            t0, dc = time.perf_counter(), new_cache()
            block = torch.ones(len(new), drafter.config.block_size, dtype=torch.bool, device=dev)
            drafter.take_in(chunk[0], chunk[2], first, lens, dc, key_valid=torch.cat([v, block], dim=1))
            draft_valid = place_rows(draft_cache, draft_valid, dc, v, idx)
            dt = time.perf_counter() - t0
            t_draft, t_joined = t_draft + dt, t_joined + dt
        else:
            draft_valid[idx] = False
            pending.append((new, *chunk))
            owed.update(zip(new, lens.tolist()))

    while True:
        finished = [i for i, r in enumerate(live) if done[r]]
        if finished and queue:                                        # their rows take the next prompts
            new, queue = queue[:len(finished)], queue[len(finished):]
            refill(finished[:len(new)], new)
            pending = still_needed(pending)
            trim()
            continue                          # (a new prompt may stop at its first token; the rest of `finished`
        if finished:                          # leaves below, as no prompt waits)
            rows = [i for i, r in enumerate(live) if not done[r]]
            live = [live[i] for i in rows]
            if not live:
                break
            sel = torch.tensor(rows, device=dev)
            select_rows(cache, sel)
            valid, anchor, start = valid[sel], anchor[sel], start[sel]
            if draft_cache is not None:
                draft_cache.batch_select_indices(sel)
                draft_valid = draft_valid[sel]
            pending = still_needed(pending)
            trim()
        if not live:                                                  # the first prompts
            new, queue = queue[:slots], queue[slots:]
            new, cache, valid, first, start, chunk = prefill(new)
            # linear-attention layers keep each verify's states, from which every row takes its own (cut_back_rows)
            record_past(cache, n_drafts + 1)
            anchor, valid, live = first.clone(), valid.clone(), list(new)     # (written in place later)
            pending = [(new, *chunk)] if chunk is not None else []
            owed.update(zip(new, start.tolist()))
            draft_cache = new_cache() if drafter is not None else None
            draft_valid = torch.zeros(len(new), 0, dtype=torch.bool, device=dev)
            continue
        room = max(budget[r] - len(tokens[r]) for r in live) - 1     # the bonus token takes the last slot
        n = min(n_drafts if fixed is None else fixed, room)
        # context positions per row the next draft takes in (its pending context, compacted)
        taken = max(owed.get(r, 0) for r in live) if pending else 0
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
            if pending:
                feats, feats_valid, feats_pos = gather(pending)
            else:                             # every live row's context is in the draft cache (new rows took theirs)
                feats = feats_pos = None
                feats_valid = torch.zeros(len(live), 0, dtype=torch.bool, device=dev)
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
            owed.clear()
            for i, copy in enumerate(copies or []):
                if copy:
                    drafted[i] = torch.tensor(copy[:n], device=dev)
        else:
            drafted = torch.empty(len(live), 0, dtype=torch.long, device=dev)
        if not copy_only:
            drafting = n > 0
        for i, r in enumerate(live):
            copied[r] = bool(copies and copies[i]) and drafted.shape[1] > 0
        t1 = time.perf_counter()
        k = drafted.shape[1] + 1
        verify_ids = torch.cat([anchor[:, None], drafted], dim=1)
        vpos = start[:, None] + torch.arange(k, device=dev)
        valid = torch.cat([valid, torch.ones(len(live), k, dtype=torch.bool, device=dev)], dim=1)
        # Every row verifies the block of the row with the most room left, so a row near the end of the context
        # has drafts past it; nothing past its budget is committed (sampling.commit), but a model must still be given
        # positions it has (a learned position table ends there): those tokens get the last one. The rows' needed
        # outputs precede them in the columns, so they never read them.
        out = target.forward(verify_ids, cache=cache, taps=taps, attention_mask=verify_mask(valid, vpos),
                             position_ids=vpos.clamp(max=target.max_length - 1), greedy=noise is None)
        best = out.tokens if noise is None else choose(out.logits, live, start + 1)
        acc, nxt = sampling.greedy_accept(drafted, best)
        t2 = time.perf_counter()
        steps += 1
        t_draft, t_verify = t_draft + t1 - t0, t_verify + t2 - t1
        if policy is not None:
            # the drafter's acceptance from the rows it drafted for (copied rows accept by other rules)
            by_drafter = None if copy_only or not n else [int(a) for i, a in enumerate(acc) if not copied[live[i]]]
            # the step's draft pays for the prompts that joined while the batch drafted (plain steps leave them
            # pending, and their catch-up is charged when drafting resumes)
            policy.update(drafted.shape[1], len(live), t2 - t1, by_drafter, t1 - t0 + t_joined, taken)
        t_joined = 0.0

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
        cut = k - int(keep.max())                                     # rejected by every row: cropped
        cut_back_rows(cache, k, k - keep, cut)
        if cut > 0:
            valid = valid[:, :-cut]
        m = k - cut
        if taps is not None:
            pending.append((list(live), out.features[:, :m], new_valid[:, :m], vpos[:, :m]))
            for r, kept in zip(live, keep.tolist()):
                owed[r] = owed.get(r, 0) + kept
        anchor = torch.tensor([tokens[r][-1] for r in live], device=dev)
        start = start + keep
        if windows:
            drop_outside_windows(cache, valid, start)
        if noise is not None:
            for r, s in zip(live, start.tolist()):
                noise[r].forget(s + 1)
    wall = time.perf_counter() - t_start
    return BatchResult([t for t in tokens], lengths, steps, wall, t_draft, t_verify, reasons)
