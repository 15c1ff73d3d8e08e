"""Block drafters: the parallel backbone proposes a whole block in one pass (method `dflash`), optionally followed
by the Domino head, which restores the dependencies inside the block (method `domino`).

docs/design.md#the-parallel-backbone and #the-domino-head give the equations.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from ..sampling import sample_from, top_children
from . import compiled_pass
from .backbone import Backbone, block_attention_mask
from .config import DrafterConfig
from .domino_head import DominoHead
from .drafter import BlockBatch, Draft, Drafter, draft_labels
from .frspec import add_noise, q_to_vocab, to_vocab
from .packed_linear import linear
from .registry import register

PREFIX_MODES = ("teacher_forcing", "ttt")


@register("dflash")
class BlockDrafter(Drafter):
    """The backbone alone: every slot drafts its own marginal argmax (or sample)."""

    def build(self, config: DrafterConfig) -> None:
        self.backbone = Backbone(config)
        self.head = None
        self.copy_input = CopyInput(config.hidden_size) if config.copy_ngram else None

    def _init_weights(self):
        super()._init_weights()
        if self.copy_input is not None:
            self.copy_input.reset_parameters()

    def body_parts(self) -> dict[str, nn.Module]:
        return {"backbone": self.backbone, **({"head": self.head} if self.head is not None else {}),
                **({"copy_input": self.copy_input} if self.copy_input is not None else {})}

    # ---- copy input ----------------------------------------------------------------------------
    def _block_embeddings(self, block_ids: torch.Tensor, copy) -> torch.Tensor:
        """Embeddings of blocks [*lead, B] of token ids -> [*lead, B, H]; with a copy input, each draft's slot also
        reads its candidate, the matched length and the copy's recent record (copy = (candidates [*lead, n], lengths
        [*lead], records [*lead, 2]) from decoding/lookup.py, or None = no candidate anywhere, which adds nothing)."""
        emb = self.embed(block_ids)
        if self.copy_input is None or copy is None:
            return emb
        cfg = self.config
        n = cfg.num_drafts
        cands, lens, record = copy
        cands = F.pad(cands[..., :n], (0, n - min(n, cands.shape[-1])), value=-1)
        add = self.copy_input(self.embed(cands.clamp(min=0)), cands >= 0, lens, record.to(emb.dtype))
        return emb + F.pad(add, (0, 0, cfg.first_draft_slot, cfg.block_size - cfg.first_draft_slot - n))

    def _draft_slots(self, ctx_feats, ctx_start, anchor, start, cache, key_valid, copy, noise, m: int, n: int,
                     topk: int):
        """The block's pass for drafting: the first m draft slots' states h [b, m, H], their draft logits
        [b, m, K'] (Gumbel `noise` added) with the columns' vocabulary ids, and the top-k (vocabulary ids, values)
        of the first n slots' logits (a `LazyTop`). A copy drafts the text's own tokens, which may be rare ones
        (names in a prompt) that an FR-Spec list leaves out, so its candidates extend the list (one more LM-head
        row each)."""
        h, base = self._block_states(ctx_feats, ctx_start, anchor, start, cache, key_valid, copy,
                                     rows=self.draft_head_rows())
        h, base = h[:, :m], base[:, :m]
        base, cols = self.draft_logits(h, copy[0] if copy is not None and self.copy_input is not None else None,
                                       base)
        base = add_noise(base, noise, cols)      # Gumbel-coupled sampling: the greedy rollout of noisy logits
        return h, base, cols, LazyTop(base[:, :n], min(topk, base.shape[-1]), cols)

    # ---- inference -----------------------------------------------------------------------------
    def _block_states(self, ctx_feats, ctx_start, anchor, start, cache, key_valid=None, copy=None, rows=None):
        """The backbone's states [b, block_size, H] of the block `[anchor, MASK, ...]` at `start`; the new context
        enters the draft cache, and only context K/V stay in it afterwards. With `rows` = the LM-head rows (weight,
        bias) to draft over, the draft slots' states and their logits over those rows come back instead: with the
        compiled backbone (options.backbone_impl) the head is part of its graph (`_compiled_pass`)."""
        cfg = self.config
        b = anchor.shape[0]
        dev = anchor.device
        compiled = (self.options.backbone_impl == "compiled" and cache is not None and key_valid is None and b == 1
                    and ctx_feats is not None and ctx_feats.shape[1])
        if (compiled and isinstance(ctx_start, int) and isinstance(start, int)
                and ctx_start + ctx_feats.shape[1] == start):  # decoding's case, the block after its context: one range
            out = self._compiled_pass(anchor, copy, ctx_feats,
                                      torch.arange(ctx_start, start + cfg.block_size, device=dev)[None], cache, rows)
        else:
            start = torch.as_tensor(start, device=dev).reshape(-1, 1)
            block_pos = (start + torch.arange(cfg.block_size, device=dev)).expand(b, -1)
            ctx_pos = None
            if ctx_feats is not None:
                ctx_start = torch.as_tensor(ctx_start, device=dev)
                ctx_pos = ctx_start if ctx_start.dim() == 2 else (      # [b, C]: every slot's own position
                    ctx_start.reshape(-1, 1) + torch.arange(ctx_feats.shape[1], device=dev)).expand(b, -1)
            if compiled:
                out = self._compiled_pass(anchor, copy, ctx_feats, torch.cat([ctx_pos, block_pos], 1), cache, rows)
            else:
                emb = self._block_embeddings(self._block_ids(anchor), copy)
                mask = key_valid[:, None, None, :] if key_valid is not None else None  # broadcast: heads, queries
                out = self.backbone(emb, block_pos, ctx_feats, ctx_pos, mask=mask, cache=cache)
                if cache is not None:
                    cache.crop(-cfg.block_size)      # keep context K/V only; block K/V are recomputed every round
                if rows is not None:
                    out = self._slot_logits(out, *rows)
        return out

    def _block_ids(self, anchor: torch.Tensor) -> torch.Tensor:
        """Blocks [b, block_size] `[anchor, MASK, ...]` of anchors [b]."""
        ids = torch.full((anchor.shape[0], self.config.block_size), self.config.mask_token_id, dtype=torch.long,
                         device=anchor.device)
        ids[:, 0] = anchor
        return ids

    def _states_pass(self, anchor, copy, ctx_feats, pos, kv, n):
        """One pass with the draft cache's key and value buffers as plain tensors, so that torch.compile takes it as
        one graph: the block's embeddings (with its copy input) and the backbone (`Backbone.infer`), which
        writes the new context's keys and values into every layer's buffers `kv` after their first n positions.
        Returns the block's states."""
        return self.backbone.infer(self._block_embeddings(self._block_ids(anchor), copy), ctx_feats, pos, kv, n)

    def _slot_logits(self, hs, weight, bias):
        """The draft slots' states of the block's states hs and their logits over the LM-head rows (weight, bias)."""
        cfg = self.config
        h = hs[:, cfg.first_draft_slot: cfg.first_draft_slot + cfg.num_drafts]
        return h, linear(h, weight, bias)

    def _draft_pass(self, anchor, copy, ctx_feats, pos, kv, n, weight, bias):
        """`_states_pass` on through the draft LM head (`_slot_logits`)."""
        return self._slot_logits(self._states_pass(anchor, copy, ctx_feats, pos, kv, n), weight, bias)

    def _compiled_pass(self, anchor, copy, ctx_feats, pos, cache, rows):
        """`_states_pass` (rows None) or `_draft_pass` (rows = (weight, bias) of the draft LM head), compiled
        (options.backbone_impl): the cache's buffers go in as tensors with room for the new context, which the pass
        writes into them, so there is no block part to crop. Graphs with dynamic lengths serve every step (the
        context grows; a step adds 1 to block-size positions): `_compiled_fn`."""
        cfg = self.config
        c = ctx_feats.shape[1]
        like = ctx_feats.new_zeros(1, cfg.num_key_value_heads, 0, cfg.head_dim)
        kv, n, handed = [], 0, []
        for i in range(cfg.num_layers):
            if i == len(cache.layers) and cache.layer_class_to_replicate is not None:
                cache.layers.append(cache.layer_class_to_replicate())
            layer = cache.layers[i] if i < len(cache.layers) else None
            if hasattr(layer, "reserve"):              # a growing layer: its own buffers
                k, v, n = layer.reserve(like, like, c)
            else:   # any other layer: its keys and values with room after them, handed to the cache after the pass
                old = ((layer.keys, layer.values) if layer is not None and layer.is_initialized and layer.keys.numel()
                       else (like, like))
                n = old[0].shape[2]
                k, v = (torch.cat([t, like.new_zeros(1, cfg.num_key_value_heads, c, cfg.head_dim)], 2) for t in old)
                handed.append(i)
            kv.append((k, v))
        if self.copy_input is not None and copy is None:      # no candidate: the same graph, adding nothing
            copy = (torch.full((1, cfg.num_drafts), -1, device=anchor.device),
                    torch.zeros(1, dtype=torch.long, device=anchor.device), ctx_feats.new_zeros(1, 2))
        # a copy: the features are a view of the verify's output, and a graph compiled for one view guards on its base;
        # a plain clone would keep the view's stride for the batch dimension, which the graphs' guards also test
        ctx_feats = ctx_feats.clone(memory_format=torch.contiguous_format)
        fn, args = (self._states_pass, ()) if rows is None else (self._draft_pass, rows)
        f, inputs = self._compiled_fn(fn, anchor, copy, ctx_feats, args), (anchor, copy, ctx_feats, pos, kv, n, *args)
        out = f(self, *inputs) if f is not None else fn(*inputs)
        for i, (k, v) in enumerate(kv):
            if i in handed:
                cache.update(k[:, :, n:], v[:, :, n:], i)
            else:
                cache.layers[i].extend(c)
        return out

    def _compiled_fn(self, fn, anchor, copy, ctx_feats, args):
        """`fn` (`_states_pass` or `_draft_pass`) compiled at its first use for every shape class a decode meets
        (compiled_pass.py: called without per-call guard checks, shared by the drafters of one structure), so that
        no later step stalls to compile. The example calls hold the cache's buffers at a length that matches no
        other dimension (torch would equate them). Without a C++ compiler (or any other compiler failure) the pass
        runs uncompiled, after one warning."""
        compiled = getattr(self, "_compiled", None)
        if compiled is None:
            compiled = self._compiled = {}
        if fn.__name__ not in compiled:
            cfg = self.config

            def kv():
                return ctx_feats.new_zeros(1, cfg.num_key_value_heads, 29, cfg.head_dim)
            examples = [(anchor, copy, ctx_feats.new_zeros(1, n_ctx, ctx_feats.shape[-1]),
                         torch.arange(n_past, n_past + n_ctx + cfg.block_size, device=anchor.device)[None].clone(),
                         [(kv(), kv()) for _ in range(cfg.num_layers)], n_past, *args)
                        for n_past, n_ctx in compiled_pass.WARM_SHAPES]
            try:
                # (one structure: the config, and the dtype and device the weights are in)
                c = compiled_pass.shared(fn.__func__, self, f"{cfg.to_json()}|{ctx_feats.dtype}|{ctx_feats.device}",
                                         examples)
            except Exception as e:      # noqa: BLE001 -- any compiler failure: the same pass, uncompiled
                warnings.warn(f"the compiled backbone is not available here ({type(e).__name__}: "
                              f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); drafting with the "
                              "eager one", stacklevel=2)
                c = None
            compiled[fn.__name__] = c
        return compiled[fn.__name__]

    @torch.no_grad()
    def take_in(self, ctx_feats, ctx_start, anchor, start, cache, key_valid=None) -> None:
        self._block_states(ctx_feats, ctx_start, anchor, start, cache, key_valid)   # (the block's states unused)

    @torch.no_grad()
    def draft(self, ctx_feats, ctx_start, anchor, start, cache, n=None, temperature=0.0, top_p=1.0, generator=None,
              topk=5, key_valid=None, ctx_ids=None, copy=None, noise=None) -> Draft:
        cfg = self.config
        n = cfg.num_drafts if n is None else min(n, cfg.num_drafts)
        impl = self.options.head_impl
        # the compiled rollout always drafts every slot (one graph per shape); it keeps the first n itself
        m = cfg.num_drafts if self.uses_head and impl == "compiled" and temperature <= 0 else n
        # [b, m, V] (FR-Spec: [b, m, K]): all slots in one parallel pass
        h, base, vm, bt = self._draft_slots(ctx_feats, ctx_start, anchor, start, cache, key_valid, copy, noise, m, n,
                                            topk)
        k = bt.k
        if not self.uses_head:               # no correction: the final logits are the base logits
            base = base[:, :n]
            tokens, q = sample_from(base.flatten(0, 1), temperature, top_p, generator)
            q = q_to_vocab(q.view(*base.shape), vm, cfg.vocab_size) if q is not None else None
            return Draft(to_vocab(tokens.view(base.shape[:2]), vm), q, bt, bt)
        embed = self.target.embed_tokens.weight
        final0 = self.head.first_final(h, base, anchor, embed, vm)     # base itself unless correct_first
        r = self.head.rollout(h, final0, anchor, embed, n, bt if final0 is base else LazyTop(final0[:, :n], k, vm),
                              self.options.candidate_pool, temperature, top_p, generator, impl=impl, vocab_ids=vm,
                              topk=k)
        return Draft(r.tokens, r.q, bt, r.top)

    @torch.no_grad()
    def tree_expander(self, ctx_feats, ctx_start, anchor, start, cache, n: int, topk: int = 5, copy=None, noise=None):
        """Tree drafting (decoding/tree.py): one backbone pass for the block at `start` (one sequence, anchor [1];
        the draft cache grows by ctx_feats as in `draft`), then an expander that scores the children of any node of
        the draft tree up to depth n. Without the head every node at depth i has the same children, slot i's
        marginal; with it the head runs along each branch (docs/design.md#tree-verification)."""
        cfg = self.config
        if anchor.shape[0] != 1:
            raise ValueError("tree drafting takes one sequence at a time")
        n = min(n, cfg.num_drafts)
        h, base, vm, bt = self._draft_slots(ctx_feats, ctx_start, anchor, start, cache, None, copy, noise, n, n, topk)
        # what the records show as the base logits: ranked only if a record reads them
        base_top = LazyTop(bt.logits[0], bt.k, bt.vocab_ids)
        if not self.uses_head:
            return SlotMarginals(base[0], vm, base_top)
        embed = self.target.embed_tokens.weight
        return self.head.branches(h, self.head.first_final(h, base, anchor, embed, vm), anchor, embed,
                                  self.options.candidate_pool, vm, base_top, self.options.head_impl)

    @torch.no_grad()
    def block_logits(self, ctx_feats: torch.Tensor, start: int, anchor: int, prefix: list[int], copy=None
                     ) -> torch.Tensor:
        """Final logits [1, n, V] of one block anchored at position `start`, its context the target features
        ctx_feats [1, start, n_taps * H] of positions 0..start-1, the head reading the given drafts `prefix`
        (teacher forcing): what another implementation computes for the same block (the interop fixture)."""
        cfg = self.config
        block = torch.full((1, cfg.block_size), cfg.mask_token_id, device=ctx_feats.device)
        block[0, 0] = anchor
        hs = self.backbone(self._block_embeddings(block, copy), torch.arange(start, start + cfg.block_size)[None],
                           ctx_feats, torch.arange(start)[None])
        h = hs[:, cfg.first_draft_slot: cfg.first_draft_slot + cfg.num_drafts]
        base = self.lm_head(h)
        if not self.uses_head:
            return base
        return self.head.corrected_logits(h, base, self.embed(torch.tensor([[anchor] + list(prefix)])))

    # ---- training ------------------------------------------------------------------------------
    def training_blocks(self, ctx_feats, input_ids, loss_mask, anchors, keep, prefix_mode="teacher_forcing",
                        copy=None) -> BlockBatch:
        """Keys are [context (S target features) | block_0 | ... | block_{N-1}]: each block `[x_a, MASK, ...]` at
        positions a..a+B-1 sees context strictly before its anchor and its own slots only. Draft i of the block at
        anchor a predicts x_{a+1+i} in both label conventions (see DrafterConfig.shift_label)."""
        cfg = self.config
        b, s = input_ids.shape
        n_blk, bs, n = anchors.shape[1], cfg.block_size, cfg.num_drafts
        dev = input_ids.device
        offs = torch.arange(bs, device=dev)
        block_ids = torch.full((b, n_blk, bs), cfg.mask_token_id, dtype=torch.long, device=dev)
        block_ids[:, :, 0] = input_ids.gather(1, anchors)
        block_pos = (anchors[:, :, None] + offs).reshape(b, n_blk * bs)
        mask = block_attention_mask(anchors, keep, s, bs)
        ctx_pos = torch.arange(s, device=dev).expand(b, -1)
        emb = self._block_embeddings(block_ids, copy).reshape(b, n_blk * bs, -1)
        hs = self.backbone(emb, block_pos, ctx_feats, ctx_pos, mask=mask)
        hs = hs.view(b, n_blk, bs, -1)[:, :, cfg.first_draft_slot: cfg.first_draft_slot + n]

        labels, valid = draft_labels(input_ids, loss_mask, anchors, keep, n)

        h = hs.reshape(b * n_blk, n, -1)
        base = self.lm_head(h)    # training scores the full vocabulary (FR-Spec restricts drafting only)
        if prefix_mode == "teacher_forcing":
            # ground truth x_a, x_{a+1}, ..., x_{a+n-1}: the GRU input before draft i is the true token
            prefix = torch.cat([block_ids[:, :, :1], labels[:, :, :-1]], dim=-1)
        elif prefix_mode == "ttt":
            # the drafter's own (detached) base argmax tokens: what it would have drafted itself
            own = base.detach().argmax(-1).view(b, n_blk, n)
            prefix = torch.cat([block_ids[:, :, :1], own[:, :, :-1]], dim=-1)
        else:
            raise ValueError(f"prefix_mode must be one of {PREFIX_MODES}")
        if self.uses_head:
            final = self.head.corrected_logits(h, base, self.embed(prefix.reshape(b * n_blk, n)))
        else:
            final = base
        v = base.shape[-1]
        return BlockBatch(base.view(b, n_blk, n, v), final.view(b, n_blk, n, v), labels, valid, prefix)


class LazyTop:
    """(vocabulary ids, values) of the k largest of logits [..., V'] whose columns are `vocab_ids` (None: all), as a
    pair that ranks the logits at its first use. A greedy chain with the fused head never uses its base top-k (the
    rollout ranks its own logits): only step records, trees and DFlash's draft-length cutoff do, and a top-k over a
    block's draft vocabulary is one of the larger ops of a compiled draft step (docs/design.md#compiled-backbone)."""

    __slots__ = ("logits", "k", "vocab_ids", "_top")

    def __init__(self, logits: torch.Tensor, k: int, vocab_ids: torch.Tensor | None):
        self.logits, self.k, self.vocab_ids, self._top = logits, k, vocab_ids, None

    def __getitem__(self, i: int) -> torch.Tensor:
        if self._top is None:
            t = self.logits.topk(self.k, dim=-1)
            self._top = (to_vocab(t.indices, self.vocab_ids), t.values)
        return self._top[i]

    def __iter__(self):
        return iter((self[0], self[1]))


class CopyInput(nn.Module):
    """What a slot reads of its copy candidate: the candidate's embedding through a learned map (initialised to the
    identity, so the candidate enters the residual stream as a token would), plus an embedding of the matched suffix
    length and a projection of the copy's recent record in this text (hits and misses over its last tokens; both
    initialised to zero): a long match in text that keeps repeating itself is worth copying, a short one in text
    that does not is chance."""

    MAX_MATCH = 16      # longer matches share the last length embedding

    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.length = nn.Embedding(self.MAX_MATCH + 1, hidden_size)
        self.record = nn.Linear(2, hidden_size, bias=False)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(self.proj.in_features))
            self.length.weight.zero_()
            self.record.weight.zero_()

    def forward(self, cand_emb: torch.Tensor, has: torch.Tensor, lengths: torch.Tensor, record: torch.Tensor
                ) -> torch.Tensor:
        """cand_emb [*lead, n, H], has [*lead, n] (False = no candidate: nothing added), lengths [*lead],
        record [*lead, 2]."""
        add = (self.proj(cand_emb) + (self.length(lengths.clamp(0, self.MAX_MATCH))
                                       + self.record(record))[..., None, :])
        return add * has[..., None].to(add.dtype)


class SlotMarginals:
    """Tree expander without a head (DFlash): the children of every node at depth i are slot i's marginal, the
    same whatever the path, so one row serves all parents of a level, and every level is ranked in one call."""

    def __init__(self, base: torch.Tensor, vocab_ids: torch.Tensor | None, base_top):
        self.base, self.vocab_ids, self.base_top = base, vocab_ids, base_top     # base [n, V or K]
        self._ranked = None

    def children(self, level: int, ids, tokens, parents, k: int):
        if self._ranked is None or self._ranked[0] != k:
            self._ranked = (k, top_children(self.base, k, self.vocab_ids))
        return tuple(x[level: level + 1] for x in self._ranked[1])


@register("domino")
class DominoDrafter(BlockDrafter):
    """The backbone + the Domino head: drafts 1.. are corrected by the GRU over the drafted prefix."""
    has_head = True

    def build(self, config: DrafterConfig) -> None:
        super().build(config)
        self.head = DominoHead(config.hidden_size, config.gru_hidden, config.rank, config.vocab_size,
                               config.correct_first)
