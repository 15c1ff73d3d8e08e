"""The Domino head: a GRU over the drafted prefix plus a low-rank correction in logit space.

S_i = GRU(E(x_anchor), E(d_1), ..., E(d_i)) with a zero state per block, over the target's frozen
embeddings; dL_i = W2 . SiLU(W1 . [H_i ; S_i]); L_i = L_base_i + dL_i; the first draft is uncorrected.
Correcting logits (not hidden states) avoids a full LM-head pass per sequential step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class DominoHead(nn.Module):
    def __init__(self, hidden_size: int, gru_hidden: int, rank: int, vocab_size: int):
        super().__init__()
        self.gru = nn.GRU(hidden_size, gru_hidden, num_layers=1, bias=False, batch_first=True)
        self.w1 = nn.Linear(hidden_size + gru_hidden, rank, bias=False)
        self.w2 = nn.Linear(rank, vocab_size, bias=False)   # own weights, not tied to the LM head

    def correction(self, h: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """dL = W2 . SiLU(W1 . [H ; S]) for any leading shape."""
        return self.w2(F.silu(self.w1(torch.cat([h, s], dim=-1))))

    def prefix_states(self, prefix_emb: torch.Tensor) -> torch.Tensor:
        """[M, n, H] embeddings of [anchor, t_1, ..., t_{n-1}] -> GRU outputs [M, n, g], zero initial state.

        Output i has consumed the anchor and i prefix tokens: the state that corrects draft i.
        """
        out, _ = self.gru(prefix_emb)
        return out

    def step(self, emb: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
        """Advance the GRU by one token: emb [b, H], state [b, g] or None (= zeros) -> new state [b, g]."""
        _, h = self.gru(emb.unsqueeze(1), None if state is None else state.unsqueeze(0).contiguous())
        return h.squeeze(0)

    def corrected_logits(self, h: torch.Tensor, base: torch.Tensor, prefix_emb: torch.Tensor) -> torch.Tensor:
        """Teacher-forced final logits for all drafts at once; draft 0 stays the base logits.

        h, base: [M, n, H], [M, n, V]; prefix_emb: [M, n, H] (anchor + the n-1 tokens before each draft).
        """
        if base.shape[1] <= 1:
            return base
        s = self.prefix_states(prefix_emb)
        delta = self.correction(h[:, 1:], s[:, 1:])
        return torch.cat([base[:, :1], base[:, 1:] + delta], dim=1)
