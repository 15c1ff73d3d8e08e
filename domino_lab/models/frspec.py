"""FR-Spec: the K most frequent tokens of the training responses, the draft vocabulary of a drafter with
`frspec_k = K` (Drafter.set_frspec installs them; they are saved in the checkpoint as the buffer `frspec_ids`).

Frequencies are counted over the supervised (loss-masked) tokens only: those are what a drafter must propose;
prompt tokens are never drafted. Verification always uses the full vocabulary, so a restricted drafter stays
lossless; it only loses acceptance on tokens outside the list.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch

from ..errors import UserError


def frequent_tokens(rows: Iterable[dict], k: int, vocab_size: int) -> list[int]:
    """rows: dicts with `input_ids` and `loss_mask` (a regenerated dataset, DrafterDataModule rows). Returns k
    sorted ids: the most frequent supervised tokens first (ties: the smaller id); when fewer than k distinct
    tokens are supervised (a small target's responses use few: ~900 of 8,192 on the embedded default), the rest
    are the most frequent prompt tokens, which responses copy (names, literals), then the smallest unseen ids,
    so the list always has k entries."""
    if not 0 < k <= vocab_size:
        raise UserError(f"FR-Spec size k must be in [1, vocab_size={vocab_size}], got {k}")
    supervised: Counter = Counter()
    prompt: Counter = Counter()
    for r in rows:
        for t, m in zip(r["input_ids"], r["loss_mask"]):
            (supervised if m else prompt)[t] += 1
    ranked = sorted(supervised, key=lambda t: (-supervised[t], t))[:k]
    seen = set(ranked)
    ranked += sorted((t for t in prompt if t not in seen), key=lambda t: (-prompt[t], t))[: k - len(ranked)]
    if len(ranked) < k:
        seen = set(ranked)
        ranked += [t for t in range(vocab_size) if t not in seen][: k - len(ranked)]
    return sorted(ranked)


def to_vocab(ids: torch.Tensor, vocab_ids: torch.Tensor | None) -> torch.Tensor:
    """Draft-vocabulary indices -> vocabulary ids (vocab_ids None: the draft vocabulary is the vocabulary)."""
    return ids if vocab_ids is None else vocab_ids[ids]


def add_noise(logits: torch.Tensor, noise: torch.Tensor | None, vocab_ids: torch.Tensor | None) -> torch.Tensor:
    """Draft logits [b, m, C] plus per-position noise over the whole vocabulary [b, >= m, V] (sampling.GumbelNoise),
    read at the draft vocabulary's columns; noise None: the logits unchanged."""
    if noise is None:
        return logits
    cols = noise[:, : logits.shape[1]]
    if vocab_ids is not None:
        cols = cols.index_select(-1, vocab_ids)
    return logits + cols.to(logits.dtype)


def q_to_vocab(q: torch.Tensor | None, vocab_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor | None:
    """A distribution over the draft vocabulary [..., K] -> over the vocabulary [..., V] (zero elsewhere)."""
    if vocab_ids is None or q is None:
        return q
    out = q.new_zeros(*q.shape[:-1], vocab_size)
    return out.scatter_(-1, vocab_ids.expand_as(q), q)


def restrict(drafter, ids):
    """The same trained drafter, drafting among `ids` only: FR-Spec applied after training, as FR-Spec itself is
    (the draft LM head and the head's W2 keep only those rows; verification is unchanged, so still lossless)."""
    from dataclasses import replace

    from .drafter import Drafter

    d = Drafter(replace(drafter.config, frspec_k=len(ids)), drafter.target)   # bound first: the target's dtype
    state = {k: v for k, v in drafter.state_dict().items() if k != "frspec_ids"}
    missing, unexpected = d.load_state_dict(state, strict=False)
    if set(missing) != {"frspec_ids"} or unexpected:
        raise UserError(f"cannot restrict this drafter's vocabulary: state mismatch {missing} {unexpected}")
    d.head_enabled, d.options = drafter.head_enabled, drafter.options
    return d.set_frspec(ids).eval()
