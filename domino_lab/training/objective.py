"""The training objective shared by every method: random anchors and the position-weighted cross-entropy.

The logits come from the drafter's own family (`Drafter.training_blocks`: one masked forward over all blocks
for the block drafters, the training-time-test unroll for the eagle chain), always in the [b, N, n, V] layout,
so every family goes through the same loss (docs/design.md#training-objective).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F



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


def weighted_ce(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, gamma: float) -> torch.Tensor:
    """Σ w·CE / Σ w over valid draft positions, w_i = exp(-i/γ)."""
    w = position_weights(labels.shape[-1], gamma, labels.device) * valid.float()
    ce = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="none").view_as(w)
    return (w * ce).sum() / (w.sum() + 1e-6)
