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


def weighted_kl(logits: torch.Tensor, target_logp: torch.Tensor, valid: torch.Tensor, gamma: float) -> torch.Tensor:
    """Σ w·KL(p ‖ q) / Σ w over valid draft positions: p = exp(target_logp) the target's next-token distribution,
    q = softmax(logits) the drafter's; zero when they match, the same weights as `weighted_ce`."""
    w = position_weights(valid.shape[-1], gamma, valid.device) * valid.float()
    kl = F.kl_div(logits.float().log_softmax(-1), target_logp, log_target=True, reduction="none").sum(-1)
    return (w * kl).sum() / (w.sum() + 1e-6)


def target_log_probs(states: torch.Tensor, lm_head, anchors: torch.Tensor, n: int) -> torch.Tensor:
    """The target's log-distribution over the token each draft predicts: draft i of the block at anchor a
    predicts x_{a+1+i}, which the target scores at position a+i. states [b, s, H] (final-normed), anchors
    [b, N] -> [b, N, n, V] (positions past the sequence repeat its last one; their drafts are not valid)."""
    b, s, _ = states.shape
    pos = (anchors[:, :, None] + torch.arange(n, device=anchors.device)).clamp(max=s - 1)
    h = states.gather(1, pos.reshape(b, -1, 1).expand(-1, -1, states.shape[-1]))
    return lm_head(h).float().log_softmax(-1).view(b, *pos.shape[1:], -1)
