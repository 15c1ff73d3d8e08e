"""The training objective shared by every method: anchors, one masked forward over all blocks, weighted CE.

One forward per batch: keys are [context (S target features) | block_0 | ... | block_{N-1}], each block
`[x_a, MASK, ...]` at positions a..a+B-1 sees context strictly before its anchor and its own slots only.
Draft i of the block at anchor a predicts x_{a+1+i} in both label conventions (see DrafterConfig).
The eagle method has no blocks: it unrolls its chain over whole sequences (training-time test, models/eagle.py)
and reads step i at the row before each anchor, so its logits come out in the same [b, N, n, V] layout and go
through the same weighted loss.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..models.backbone import block_attention_mask

PREFIX_MODES = ("teacher_forcing", "ttt")


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random anchors among response positions a with loss_mask[a] and loss_mask[a+1] (the first label is
    supervised). Returns sorted anchors [b, N] and a keep mask (False = padding when too few candidates)."""
    b, s = loss_mask.shape
    valid = torch.zeros_like(loss_mask, dtype=torch.bool)
    valid[:, :-1] = loss_mask[:, :-1].bool() & loss_mask[:, 1:].bool()
    scores = torch.rand(b, s, generator=generator, device=loss_mask.device)
    scores = scores.masked_fill(~valid, -1.0)          # invalid positions sort last
    n = min(num_anchors, s)
    top = scores.topk(n, dim=-1)
    keep = top.values >= 0
    anchors = torch.where(keep, top.indices, torch.zeros_like(top.indices))
    # sort kept anchors ascending; padding (anchor 0, keep False) goes to the end
    order = torch.where(keep, anchors, torch.full_like(anchors, s)).argsort(dim=-1)
    return anchors.gather(1, order), keep.gather(1, order)


def position_weights(n: int, gamma: float, device=None) -> torch.Tensor:
    """exp(-i/γ) for draft i: an early miss rejects everything after it, so early drafts matter most."""
    return torch.exp(-torch.arange(n, device=device, dtype=torch.float32) / gamma)


@dataclass
class BlockBatch:
    logits_base: torch.Tensor    # [b, N, n, V]
    logits_final: torch.Tensor   # [b, N, n, V]
    labels: torch.Tensor         # [b, N, n]
    valid: torch.Tensor          # [b, N, n] bool
    prefix: torch.Tensor         # [b, N, n] tokens the GRU read


def _labels(input_ids, loss_mask, anchors, keep, n):
    """Labels x_{a+1+i} [b, N, n] of every anchor's drafts, and which of them are supervised."""
    b, s = input_ids.shape
    lab_pos = anchors[:, :, None] + 1 + torch.arange(n, device=input_ids.device)     # [b, N, n]
    in_range = lab_pos < s
    lab_pos_c = lab_pos.clamp(max=s - 1).view(b, -1)
    labels = input_ids.gather(1, lab_pos_c).view(b, -1, n)
    valid = in_range & loss_mask.gather(1, lab_pos_c).view(b, -1, n).bool() & keep[:, :, None]
    return labels, valid


def _eagle_blocks(drafter, ctx_feats, input_ids, loss_mask, anchors, keep) -> BlockBatch:
    """EAGLE TTT: n chain steps from each anchor (ground-truth tokens, the drafter's own features after step 0)."""
    from ..models.eagle import eagle_blocks

    n = drafter.config.num_drafts
    labels, valid = _labels(input_ids, loss_mask, anchors, keep, n)
    valid = valid & (anchors >= 1)[:, :, None]          # the chain starts at the row before the anchor
    logits = drafter.lm_head(eagle_blocks(drafter, ctx_feats, input_ids, anchors))
    prefix = torch.cat([input_ids.gather(1, anchors)[:, :, None], labels[:, :, :-1]], dim=-1)
    return BlockBatch(logits, logits, labels, valid, prefix)


def forward_blocks(drafter, ctx_feats: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                   anchors: torch.Tensor, keep: torch.Tensor, prefix_mode: str = "teacher_forcing") -> BlockBatch:
    cfg = drafter.config
    if cfg.method == "eagle":
        # prefix_mode does not apply: eagle always reads ground-truth tokens with its own features (EAGLE-3 TTT)
        return _eagle_blocks(drafter, ctx_feats, input_ids, loss_mask, anchors, keep)
    b, s = input_ids.shape
    n_blk, bs, n = anchors.shape[1], cfg.block_size, cfg.num_drafts
    dev = input_ids.device
    offs = torch.arange(bs, device=dev)
    block_ids = torch.full((b, n_blk, bs), cfg.mask_token_id, dtype=torch.long, device=dev)
    block_ids[:, :, 0] = input_ids.gather(1, anchors)
    block_pos = (anchors[:, :, None] + offs).reshape(b, n_blk * bs)
    mask = block_attention_mask(anchors, keep, s, bs)
    ctx_pos = torch.arange(s, device=dev).expand(b, -1)
    hs = drafter.backbone(drafter.embed(block_ids.reshape(b, -1)), block_pos, ctx_feats, ctx_pos, mask=mask)
    hs = hs.view(b, n_blk, bs, -1)[:, :, cfg.first_draft_slot: cfg.first_draft_slot + n]

    labels, valid = _labels(input_ids, loss_mask, anchors, keep, n)

    h = hs.reshape(b * n_blk, n, -1)
    base = drafter.lm_head(h)
    if prefix_mode == "teacher_forcing":
        # ground truth x_a, x_{a+1}, ..., x_{a+n-1}: the GRU input before draft i is the true token
        prefix = torch.cat([block_ids[:, :, :1], labels[:, :, :-1]], dim=-1)
    elif prefix_mode == "ttt":
        # the drafter's own (detached) base argmax tokens: what it would have drafted itself
        own = base.detach().argmax(-1).view(b, n_blk, n)
        prefix = torch.cat([block_ids[:, :, :1], own[:, :, :-1]], dim=-1)
    else:
        raise ValueError(f"prefix_mode must be one of {PREFIX_MODES}")
    if drafter.uses_head:
        final = drafter.head.corrected_logits(h, base, drafter.embed(prefix.reshape(b * n_blk, n)))
    else:
        final = base
    v = base.shape[-1]
    return BlockBatch(base.view(b, n_blk, n, v), final.view(b, n_blk, n, v), labels, valid, prefix)


def weighted_ce(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, gamma: float) -> torch.Tensor:
    """Σ w·CE / Σ w over valid draft positions, w_i = exp(-i/γ)."""
    w = position_weights(labels.shape[-1], gamma, labels.device) * valid.float()
    ce = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="none").view_as(w)
    return (w * ce).sum() / (w.sum() + 1e-6)
