"""Lossless speculative decoding: prefill, draft a block, verify it in one target forward, accept, crop.

`drafter=None` runs plain autoregressive decoding through the very same target-cache code (a verify
step with zero drafts), so the baseline and the speculative path differ only in the drafts. `tree_nodes` > 0
verifies a draft tree per step instead of the chain (`_tree_step`, decoding/tree.py).
"""
from __future__ import annotations

import math
import time
from typing import Callable

import torch

from ..errors import UserError
from ..validation import check_drafter, check_int, check_seed, check_token_ids, fresh_seed
from .records import GenerationResult, StepRecord
from . import tree as trees
from .adaptive import PlainFallback
from .kv_cache import (check_layers, check_positions, check_recording, layer_masks, new_cache, record_past,
                       window_layout, window_offset)
from .lookup import copy_index, copy_inputs, draft_lookup
from .. import sampling


def prompt_token_ids(target, prompt: str | None = None, prompt_ids=None, what: str = "the prompt") -> list[int]:
    """The token ids of a prompt (text or ids), checked: not empty and leaving room in the target's context for at
    least one new token. `what` names the prompt in the error (callers checking a whole file first pass its id)."""
    if (prompt is None) == (prompt_ids is None):
        raise UserError("give exactly one of prompt (text) or prompt_ids")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise UserError(f"{what} must be text (a str); pass token ids as prompt_ids, got {type(prompt).__name__}")
        if not prompt.strip():
            raise UserError(f"{what} is empty; give some text to continue")
        ids = target.encode(prompt)
    else:
        ids = check_token_ids(prompt_ids, target.vocab_size, what)
    if not ids:
        raise UserError(f"{what} is empty; give some text to continue")
    if len(ids) >= target.max_length:
        raise UserError(f"{what} has {len(ids)} tokens but the target's context is {target.max_length}; "
                        "shorten it")
    return ids


def prompts_token_ids(target, rows: list[dict], of: str | None = None) -> list[list[int]]:
    """The token ids of every prompt of `rows` ({id, prompt}), all checked as prompt_token_ids does before anything
    is decoded; an error names the prompt by its id and place (`of`: the set's name; default: the count)."""
    return [prompt_token_ids(target, row["prompt"], what=f"prompt {row['id']!r} (number {i} of {of or len(rows)})")
            for i, row in enumerate(rows, 1)]


# The drafter's own top-k when the records keep none: the draft-length cutoff estimates each draft's probability
# from its final top-k logits (sampling.confident_prefix), so that estimate must not depend on what is recorded.
DRAFT_TOPK = 5
RECORD_TOPK = 5     # what the CLIs keep per position when they print step records (`--steps`)


def _topk(logits: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
    t = logits.float().topk(min(k, logits.shape[-1]), dim=-1)
    return t.indices.tolist(), t.values.tolist()


@torch.no_grad()
def speculative_generate(target, drafter=None, prompt: str | None = None, prompt_ids=None, max_new_tokens: int = 128,
                         temperature: float = 0.0, top_p: float = 1.0, block_size: int | None = None,
                         seed: int | None = None, topk: int = 0,
                         on_step: Callable[[StepRecord], None] | None = None, tree_nodes: int = 0,
                         sampler: str = "rejection") -> GenerationResult:
    """Generate up to `max_new_tokens` tokens; greedy output equals the target's own greedy output.

    `on_step(record)` is called after every verify step, once its tokens are committed (the dashboard streams
    from it; an exception it raises stops the decode). `tree_nodes` N > 0 verifies a draft tree of N nodes per
    step instead of the chain (block drafters; greedy or sampled, exact either way; docs/design.md#tree-verification).

    `topk` k > 0 stores in every step record the top-k of the target's logits at each verified position and of the
    drafter's base and corrected logits at each draft (the dashboard's inspector, `generate --steps`); 0 (the
    default) stores none: a top-k over the target's vocabulary and its conversion to lists every step, for records
    that only a viewer reads.

    `sampler` (T > 0): "rejection", standard speculative sampling (the drafter samples; exact in distribution), or
    "gumbel", Gumbel-max coupling (sampling.GumbelNoise: the text is a function of the seed alone, the same for
    plain decoding and every drafter, chain or tree; docs/design.md#gumbel-coupled-sampling)."""
    max_new_tokens = check_int(max_new_tokens, "max_new_tokens", 1)
    check_drafter(drafter, target)
    sampling.check_sampling(temperature, top_p, sampler, drafter is not None and drafter.options.tree_sampled)
    if seed is not None:
        seed = check_seed(seed)
    topk = check_int(topk, "topk", 0, what=" (0 = no top-k in the step records)")
    if block_size is not None:
        block_size = check_int(block_size, "block_size", 1)
    draft_k = topk or DRAFT_TOPK
    tree_nodes = trees.check_tree_nodes(tree_nodes)
    if tree_nodes:
        check_tree_mode(drafter)
    adaptive = drafter is not None and drafter.options.adaptive_drafts
    check_adaptive_mode(adaptive, tree_nodes)
    min_copy = drafter.options.lookup if drafter is not None else 0
    check_lookup_mode(drafter, min_copy)
    ids = prompt_token_ids(target, prompt, prompt_ids)
    # the target's context may leave room for fewer tokens than asked: a run that fills it stops for that reason
    cut_by_context = target.max_length - len(ids) < max_new_tokens
    max_new_tokens = min(max_new_tokens, target.max_length - len(ids))
    dev = target.device
    gen = torch.Generator(device=dev)
    seed = seed if seed is not None else fresh_seed()
    gen.manual_seed(seed)
    greedy = temperature <= 0
    # Gumbel-coupled sampling verifies like greedy decoding: the target's token at each position is its Gumbel-max
    # draw (one noise vector per position), the drafter proposes its own noisy argmax, a draft stands while equal
    noise = sampling.GumbelNoise(seed, target.vocab_size, temperature, dev) if not greedy and sampler == "gumbel" \
        else None
    n_drafts = 0
    if drafter is not None:
        n_drafts = drafter.config.num_drafts
        block_size = block_size if block_size is not None else drafter.options.block_size
        if block_size is not None:
            n_drafts = min(n_drafts, block_size if drafter.config.shift_label else block_size - 1)
            if n_drafts < 1:
                raise UserError(f"block size {block_size} leaves no draft tokens for this drafter")
    taps = drafter.config.target_layer_ids if drafter is not None else None
    eos = target.eos_token_ids

    t_start = time.perf_counter()
    # the most the caches hold: the prompt, the new tokens and one verify's drafts (the drafter's cache: its
    # context and a block); a buffer of that size is allocated once (docs/design.md#kv-cache)
    capacity = len(ids) + max_new_tokens + max(n_drafts, tree_nodes) + 1
    # (sliding-window layers keep only their window: kv_cache.WindowLayer)
    cache = new_cache(target.model.config, capacity=capacity, bounded_windows=True)
    if drafter is not None and not tree_nodes:                  # (trees: check_tree_mode)
        check_layers(target.model.config, "speculative decoding", chain=True, cache=cache)
        check_recording(target, "speculative decoding")
    out = target.forward(torch.tensor([ids], device=dev), cache=cache, taps=taps, last_logits_only=True,
                         greedy=greedy)
    if greedy:
        first = out.tokens[:, -1]
    elif noise is not None:
        first = sampling.gumbel_choice(out.logits[:, -1], noise.rows([len(ids)]), temperature, top_p)
    else:
        first = sampling.sample_from(out.logits[:, -1], temperature, top_p, gen)[0]
    tokens = [int(first)]
    calls = 1
    prefill_time = time.perf_counter() - t_start
    # linear-attention layers keep the states of a verify's tokens until the crop below picks the accepted one
    recording = drafter is not None and record_past(cache, n_drafts + 1)
    pending = out.features[0] if taps is not None else None     # context not yet in the draft cache
    pending_start = 0
    draft_cache = new_cache(capacity=capacity + drafter.config.block_size) if drafter is not None else None
    start = len(ids)                                             # position of the current anchor
    steps: list[StepRecord] = []
    stop = "eos" if tokens[-1] in eos else None
    lookup = draft_lookup(min_copy, ids + tokens) if min_copy else None
    # a drafter with a copy input reads each block's copy candidates (models/block.py#CopyInput)
    copy_k = drafter.config.copy_ngram if drafter is not None else 0
    copier = copy_index(copy_k) if copy_k else None          # (caught up with the text when a draft reads it)
    policy = PlainFallback(n_drafts) if adaptive and n_drafts else None    # draft, or a plain step where it pays

    while stop is None and len(tokens) < max_new_tokens:
        anchor = tokens[-1]
        remaining = max_new_tokens - len(tokens)
        n = min(n_drafts, remaining - 1)   # the bonus token takes the last slot of the budget
        t0 = time.perf_counter()
        copy = lookup.offer(n) if lookup is not None and n > 0 else []
        taken = pending.shape[0] if pending is not None else 0     # context positions the next draft takes in
        if policy is not None and not copy:
            n = policy.choose(n)
        use_copier = copier is not None and n > 0 and not copy
        if use_copier:
            copier.catch_up(ids, tokens)
        cands = copy_inputs([copier], n_drafts, dev) if use_copier else None
        if tree_nodes and not copy:
            rec, new_feats = _tree_step(target, drafter, cache, draft_cache, pending, pending_start, anchor, start,
                                        n, tree_nodes, taps, eos, max_new_tokens - len(tokens), topk, draft_k, cands,
                                        temperature, top_p, gen, noise)
            if n > 0:
                pending = None                     # the drafter has taken it into its cache
        else:
            draft = None
            if copy:                               # the text repeats itself: verify the copy, skip the drafter
                drafts = torch.tensor(copy, device=dev)
            elif n > 0:
                seq = ids + tokens                 # token at every position so far (eagle pairs rows with them)
                ctx_ids = torch.tensor([seq[pending_start:start]], device=dev) if pending is not None else None
                draft = drafter.draft(pending[None] if pending is not None else None, pending_start,
                                      torch.tensor([anchor], device=dev), start, draft_cache, n=n,
                                      temperature=0.0 if noise is not None else temperature, top_p=top_p,
                                      generator=gen, topk=draft_k, ctx_ids=ctx_ids, copy=cands,
                                      # (every slot's row: the compiled head rolls out the whole block)
                                      noise=noise.rows(range(start + 1, start + 1 + drafter.config.num_drafts))[None]
                                      if noise is not None else None)
                pending = None
                drafts = draft.tokens[0]
                if drafter.options.draft_cutoff > 0:      # verify only the drafts likely to be accepted
                    drafts = drafts[: sampling.confident_prefix(draft.final_topk[1][0], drafter.options.draft_cutoff)]
            else:
                drafts = torch.empty(0, dtype=torch.long, device=dev)
            t1 = time.perf_counter()
            draft_list = drafts.tolist()
            # greedy without records reads only the target's argmax tokens (Target.greedy_tokens)
            # positions given, not left to the model: some (Bamba's) count them from 0 in every forward without them
            out = target.forward(torch.tensor([[anchor] + draft_list], device=dev), cache=cache, taps=taps,
                                 position_ids=torch.arange(start, start + 1 + len(draft_list), device=dev)[None],
                                 greedy=greedy and not topk)
            logits = out.logits[0] if out.logits is not None else None
            # the Gumbel noise of every verified position (the drafter's rows, and the bonus position's)
            verified_noise = noise.rows(range(start + 1, start + 2 + len(draft_list))) if noise is not None else None
            if greedy or noise is not None:
                # the target's own token at each verified position: its argmax, or its Gumbel-max draw
                best = (sampling.gumbel_choice(logits, verified_noise, temperature, top_p) if noise is not None
                        else out.tokens[0] if logits is None else logits.argmax(-1))
                acc, nxt = sampling.greedy_accept_one(draft_list, best)
            else:
                p = sampling.warp_probs(logits, temperature, top_p)
                # copied (or no) drafts: q None, the point mass on each token
                acc, nxt = sampling.rejection_accept(drafts, draft.q[0, : len(drafts)] if draft is not None else None,
                                                     p, gen)
            t2 = time.perf_counter()
            if policy is not None:     # a copy's acceptance says nothing about the drafter's
                policy.update(len(drafts), acc + 1, t1 - t0, t2 - t1, drafted=draft is not None,
                              steady=taken <= n_drafts + 1)

            committed, acc, bonus = sampling.commit(draft_list[:acc], nxt, eos, max_new_tokens - len(tokens))
            # Target cache: it now holds start + n + 1 positions; keep the anchor and the accepted drafts.
            # (linear-attention layers refuse a crop unless recording, and while recording need one every step, by 0
            # too, which frees the states they recorded)
            if len(drafts) > acc or recording:
                cache.crop(-(len(drafts) - acc))
            new_feats = out.features[0, : acc + 1] if taps is not None else None
            rec = StepRecord(start=start, anchor=anchor, draft_tokens=draft_list, accepted=acc, bonus=bonus,
                             committed=committed, draft_time_s=t1 - t0, verify_time_s=t2 - t1, copied=bool(copy))
            if topk:
                # under gumbel the drafter's stored top-k already carry the noise; the target's get the same rows,
                # so each list ranks what its side took the argmax of
                scored = logits if noise is None else logits.float() + verified_noise
                rec.target_topk_ids, rec.target_topk_logits = _topk(scored, topk)
                rec.gumbel_scores = noise is not None
                if draft is not None:       # one per verified draft (the cutoff may have verified fewer)
                    k = len(draft_list)
                    rec.base_topk_ids = draft.base_topk[0][0, :k].tolist()
                    rec.base_topk_logits = draft.base_topk[1][0, :k].float().tolist()
                    rec.final_topk_ids = draft.final_topk[0][0, :k].tolist()
                    rec.final_topk_logits = draft.final_topk[1][0, :k].float().tolist()
        # chain or tree alike: the anchor's and the accepted drafts' features are the drafter's next new context
        calls += 1
        if taps is not None:
            pending = new_feats if pending is None else torch.cat([pending, new_feats])
            pending_start = start + rec.accepted + 1 - pending.shape[0]
        steps.append(rec)
        tokens.extend(rec.committed)
        if lookup is not None:
            lookup.update(rec.committed, rec.accepted, len(rec.draft_tokens), rec.copied)
        start += rec.accepted + 1
        if noise is not None:
            noise.forget(start + 1)                # positions up to the anchor's are committed
        if on_step is not None:
            on_step(rec)
        if any(t in eos for t in rec.committed):
            stop = "eos"
    wall = time.perf_counter() - t_start
    return GenerationResult(prompt_ids=ids, token_ids=tokens, text=target.decode(tokens) if target.tokenizer else "",
                            steps=steps, target_forward_calls=calls, wall_time_s=wall, prefill_time_s=prefill_time,
                            stop_reason=stop or ("context_length" if cut_by_context else "max_new_tokens"))


def check_tree_mode(drafter) -> None:
    """Tree verification needs a block drafter and a target of full or sliding-window attention layers that reads
    the positions it is given; anything else is one clear error."""
    if drafter is None:
        raise UserError("tree verification (tree nodes > 0) needs a drafter; plain decoding has nothing to verify")
    if not hasattr(drafter, "tree_expander"):
        raise UserError(f"tree verification needs a block drafter (dflash or domino); the "
                        f"'{drafter.config.method}' drafter drafts one chain: use tree nodes 0 with it")
    check_layers(drafter.target.model.config, "tree verification")
    check_positions(drafter.target, "tree verification", "use chain verification (tree nodes 0)")


def check_adaptive_mode(adaptive: bool, tree_nodes: int) -> None:
    """Adaptive drafts decide whether a chain step drafts; a tree's size is its node budget instead."""
    if adaptive and tree_nodes:
        raise UserError("adaptive drafts choose a chain's length; they do not apply to tree verification: "
                        "use tree nodes 0 or turn adaptive drafts off")


def check_lookup_mode(drafter, lookup: int) -> None:
    """Lookup drafting copies text in place of a drafter's block (or tree): it needs a drafter."""
    if lookup and drafter is None:
        raise UserError("lookup drafting copies text in place of a drafter's block; give a drafter or set lookup 0")


def _tree_step(target, drafter, cache, draft_cache, pending, pending_start, anchor, start, n, tree_nodes, taps, eos,
               room, topk, draft_k, copy=None, temperature=0.0, top_p=1.0, gen=None, noise=None):
    """One tree round at `anchor` (position `start`): draft a tree of up to `tree_nodes` nodes and depth
    n, verify it in one target forward, accept a path plus its bonus (greedy: the longest path the target agrees
    with; T > 0: the path speculative sampling walks, `trees.sampled_path`), and keep only that path in the target's
    cache. Returns the step record and the tapped features of the anchor and the accepted nodes (the next round's
    new context for the draft cache, exactly as in a chain)."""
    greedy = temperature <= 0
    pick = greedy or noise is not None       # the walk follows the target's chosen token (argmax or Gumbel-max)
    dev = target.device
    t0 = time.perf_counter()
    expander = None
    tree = trees.Tree()
    if n > 0:
        expander = drafter.tree_expander(pending[None] if pending is not None else None, pending_start,
                                         torch.tensor([anchor], device=dev), start, draft_cache, n=n,
                                         topk=draft_k, copy=copy,
                                         noise=noise.rows(range(start + 1, start + 1 + n))[None]
                                         if noise is not None else None)
        if not pick and drafter.options.tree_sampled:
            tree = trees.sample_tree(expander, tree_nodes, n, temperature, gen, topk=draft_k)
        else:
            p_min = drafter.options.tree_min_prob
            floor = math.log(p_min) if p_min > 0 else -math.inf
            tree = trees.build_tree(expander, tree_nodes, n, draft_k, floor)
    t1 = time.perf_counter()
    verify_ids = torch.tensor([[anchor] + tree.tokens], device=dev)
    # the LM head runs on the rows the walk is likely to visit (the anchor and its line of best children), in one
    # call, and again for the line below a node where the walk leaves that line: rarely all N + 1 rows
    likely = trees.likely_rows(tree)
    pos = trees.positions(tree, start, dev)
    mask = trees.attention_mask(tree, start, target.dtype, dev)
    if window_layout(target.model.config) is not None:      # windows go into the tree's mask too (its keys' positions)
        mask = layer_masks(target.model.config, mask, pos, torch.cat([torch.arange(start, device=dev)[None], pos], 1),
                           dropped=window_offset(cache))
    out = target.forward(verify_ids, cache=cache, taps=taps, attention_mask=mask, position_ids=pos, logits_rows=[])
    hidden = out.hidden[0]
    rows_logits: dict[int, torch.Tensor] = {}     # kept for the step record's top-k only
    rows_next: dict[int, int] = {}

    def read(rows: list[int]) -> None:
        """The target's logits (T > 0, or for the record's top-k) or only its next token (greedy) at these verify
        rows, the LM head run on them alone."""
        if topk or not greedy:
            logits = target.logits_at(hidden[rows])
            rows_logits.update(zip(rows, logits))
            if not pick:
                return
            # row r predicts the token at position start + 1 + depth (row 0: the anchor, depth 0)
            best = (logits.argmax(-1) if noise is None else sampling.gumbel_choice(
                logits, noise.rows([start + 1 + (tree.depths[r - 1] if r else 0) for r in rows]), temperature, top_p))
        else:
            best = target.greedy_tokens(hidden[rows])
        rows_next.update(zip(rows, best.tolist()))

    read(likely)

    def next_token(row: int) -> int:
        if row not in rows_next:
            read(trees.likely_rows(tree, row - 1))
        return rows_next[row]

    def probs(row: int) -> torch.Tensor:
        if row not in rows_logits:
            read(trees.likely_rows(tree, row - 1))
        return sampling.warp_probs(rows_logits[row], temperature, top_p)

    path, nxt = trees.greedy_path(tree, next_token) if pick else trees.sampled_path(tree, probs, gen)
    t2 = time.perf_counter()

    committed, acc, bonus = sampling.commit([tree.tokens[i] for i in path], nxt, eos, room)
    rows = [0] + [i + 1 for i in path[:acc]]        # verify rows kept: the anchor and the accepted nodes
    trees.compact_cache(cache, start, rows)
    new_feats = out.features[0, rows] if taps is not None else None
    shown = trees.reported_path(tree, path[:acc])
    rec = StepRecord(start=start, anchor=anchor, draft_tokens=[tree.tokens[i] for i in shown], accepted=acc,
                     bonus=bonus, committed=committed, draft_time_s=t1 - t0, verify_time_s=t2 - t1,
                     tree_tokens=list(tree.tokens), tree_parents=list(tree.parents), tree_path=path[:acc])
    if not topk:
        return rec, new_feats
    # the target's top-k at every row the walk read: the anchor and each accepted node (the reported drafts' rows)
    walked = torch.stack([rows_logits[r] for r in rows[: len(shown) + 1]])
    if noise is not None:                          # the Gumbel-coupled scores, as in a chain step's record
        walked = walked.float() + noise.rows(range(start + 1, start + 1 + len(walked)))
    rec.target_topk_ids, rec.target_topk_logits = _topk(walked, topk)
    rec.gumbel_scores = noise is not None
    if expander is not None and shown:
        rec.base_topk_ids = expander.base_top[0][: len(shown)].tolist()
        rec.base_topk_logits = expander.base_top[1][: len(shown)].float().tolist()
        # final: the drafter's children of each reported node's parent (for DFlash these are the base top-k)
        tops = [tree.child_top[p] for p in [-1] + shown[:-1]]
        rec.final_topk_ids, rec.final_topk_logits = [t[0] for t in tops], [t[1] for t in tops]
    return rec, new_feats
