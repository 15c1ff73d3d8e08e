"""Drafting by copying: the continuation of the latest earlier occurrence of the text's own suffix.

A model drafter predicts; it does not copy. Small targets (and large ones on code) fall into loops and quote their
prompt, and then the next tokens are already in the context: prompt lookup (an n-gram copier) drafts them exactly,
where a trained drafter keeps guessing its training prior (docs/design.md#lookup-drafting). The engine asks
`NgramLookup.propose` before every step and, when the suffix match is long enough, verifies the copy instead of
calling the drafter (which then skips that step: its context catches up at the next call); `update` after it.
`offer` is `propose` behind the engine's test of whether copying pays in this text (docs/design.md#lookup-drafting).
"""
from __future__ import annotations

from collections import deque

import torch

from ..models.options import LOOKUP_MAX

MAX_NGRAM = LOOKUP_MAX      # longest suffix matched; longer matches are tried first (they are the most reliable)
MIN_RECORD = 4      # tokens at which a copy had a match before `offer` trusts the text's record of them


class NgramLookup:
    """An index from every n-gram (min_ngram ≤ n ≤ MAX_NGRAM) of the sequence so far to the position right after
    its latest occurrence, kept up to date token by token (O(MAX_NGRAM) per token, no rescans)."""

    def __init__(self, min_ngram: int, tokens: list[int] = (), adaptive: bool = True, track: int = 0):
        if min_ngram < 1:
            raise ValueError("min_ngram must be >= 1")
        self.min_ngram = min_ngram
        self.need = min_ngram              # the match length a copy currently needs (see `update`)
        self.adaptive = adaptive
        self._drafted = self._drafted_accepted = 0
        self.seq: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}
        # track > 0: for the last `track` tokens, whether a copy would have drafted each one as its first token
        # (1), drafted another (0), or had no match (None): how well copying has done in this text so far
        self.recent: deque | None = deque(maxlen=track) if track else None
        self.extend(tokens)

    def extend(self, tokens) -> None:
        seq, lo = self.seq, self.min_ngram
        for t in tokens:
            t, j = int(t), len(seq)        # t lands at j: the n-grams ending just before j continue with it
            keys = [tuple(seq[j - n: j]) for n in range(lo, min(MAX_NGRAM, j) + 1)]     # keys[n - lo]: length n
            if self.recent is not None:    # would a copy have drafted t? `propose(1)`, reusing these keys
                first = None
                for k in reversed(keys[self.need - lo: j - lo]):       # lengths need .. j-1, longest first
                    first = self._after.get(k)
                    if first is not None:
                        break
                self.recent.append(None if first is None else seq[first] == t)
            seq.append(t)
            for k in keys:
                self._after[k] = j

    def catch_up(self, prompt: list[int], tokens: list[int]) -> None:
        """Extend the index to the text prompt + tokens, of which it has seen a prefix. The decoders keep a
        drafter's copy index this way, only when a draft reads it: steps without a draft cost it nothing."""
        n, p = len(self.seq), len(prompt)
        self.extend(prompt[n:] + tokens[max(0, n - p):])

    def propose(self, k: int) -> tuple[list[int], int]:
        """Up to k tokens continuing the longest suffix (≥ min_ngram tokens) that occurred before, and the matched
        length (0 and [] when nothing matches). A match close to the end is a loop of period d = len - start; its
        copy runs past the end by repeating that period, which is what the loop will do if it goes on."""
        seq = self.seq
        for n in range(min(MAX_NGRAM, len(seq) - 1), self.need - 1, -1):
            start = self._after.get(tuple(seq[-n:]))
            if start is None:
                continue
            out: list[int] = []
            for i in range(k):
                j = start + i
                out.append(seq[j] if j < len(seq) else out[j - len(seq)])
            return out, n
        return [], 0

    def record(self) -> tuple[int, int]:
        """(hits, misses) over the tracked tokens: how many a copy would have drafted right as its first token, and
        how many wrong (tokens with no match count in neither)."""
        hits = sum(1 for h in self.recent if h)
        return hits, sum(1 for h in self.recent if h is False)

    def offer(self, k: int) -> list[int]:
        """What the engine verifies instead of the drafter's block: `propose(k)`'s copy, or [] when this text's
        record says copying does not pay. Of the recent tokens at which a copy (at the current match length) had a
        match, a fraction h started right; a copy of n tokens then commits about 1 + h + ... + h^n (its bonus
        included), which must reach what the drafter's steps commit on average in this text. Decided from committed
        tokens only, so it keeps sampling exact (docs/design.md#lookup-drafting). Needs `track`; a lookup
        without it, or a fixed one (adaptive False), offers every match."""
        toks, _ = self.propose(k)
        if not toks or not self.adaptive or self.recent is None or not self._drafted:
            return toks
        hits, misses = self.record()
        if hits + misses < MIN_RECORD:
            return toks
        h = hits / (hits + misses)
        expected = sum(h ** i for i in range(len(toks) + 1))
        return toks if expected >= 1 + self._drafted_accepted / self._drafted else []

    def update(self, committed: list[int], accepted: int, proposed: int, copied: bool) -> None:
        """After every verify step: index the committed tokens, and adapt the match length a copy needs. A copy
        that committed fewer drafts than the drafter's steps do on average in this text raises it by one; a copy
        accepted whole lowers it back toward min_ngram. Text whose repeats do not continue the same way (math
        solutions reuse phrases, then differ) thus stops overriding a drafter that predicts it well, while loops
        keep copying. A step that verified nothing past its anchor (a plain step) only indexes its token."""
        self.extend(committed)
        if not proposed:
            return
        if not copied:
            self._drafted += 1
            self._drafted_accepted += accepted
            return
        if not self.adaptive:
            return
        if accepted < self._drafted_accepted / max(1, self._drafted) or accepted == 0:
            self.need = min(self.need + 1, MAX_NGRAM)
        elif accepted == proposed:
            self.need = max(self.need - 1, self.min_ngram)


def draft_lookup(min_ngram: int, tokens: list[int] = ()) -> NgramLookup:
    """The engine's lookup drafting index (adaptive match length, the copy's record kept for `offer`)."""
    return NgramLookup(min_ngram, tokens, track=COPY_TRACK)


# ---- candidates for drafters with a copy input (DrafterConfig.copy_ngram) ---------------------------------------
# Such a drafter reads, for each slot of its block, the token a copy would draft there (docs/design.md#copy-input);
# training and decoding compute the candidates with the same index, so the drafter sees the same inputs in both.

COPY_TRACK = 32     # tokens over which a copy drafter's inputs count the copy's recent hits and misses


def copy_index(min_ngram: int, tokens: list[int] = ()) -> NgramLookup:
    """The index a drafter with a copy input reads its candidates from (fixed match length, hits tracked)."""
    return NgramLookup(min_ngram, tokens, adaptive=False, track=COPY_TRACK)


def _inputs(ix: NgramLookup, n: int) -> tuple[list[int], int, list[float]]:
    toks, m = ix.propose(n)
    hits, misses = ix.record()
    return toks + [-1] * (n - len(toks)), m, [hits / COPY_TRACK, misses / COPY_TRACK]


def _field(rows: list, k: int) -> list:
    """Field k of every (candidates, length, record) triple in a list of them, or in a list of such lists."""
    return [_field(r, k) if isinstance(r, list) else r[k] for r in rows]


def _as_tensors(rows: list, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # the record stays float32: the drafter casts it to its own dtype where it reads it
    return (torch.tensor(_field(rows, 0), dtype=torch.long, device=device),
            torch.tensor(_field(rows, 1), dtype=torch.long, device=device),
            torch.tensor(_field(rows, 2), dtype=torch.float32, device=device))


def copy_inputs(indexes: list[NgramLookup], n: int, device=None):
    """A drafter's `copy` argument from each row's index (copy_index): candidates [b, n] (-1 where the copy has no
    token), matched suffix lengths [b] (0 = no match) and the copy's recent record [b, 2] (the fractions of the
    last COPY_TRACK tokens a copy drafted right and wrong)."""
    return _as_tensors([_inputs(ix, n) for ix in indexes], device)


def block_copy_inputs(input_ids: torch.Tensor, anchors: torch.Tensor, n: int, min_ngram: int):
    """Training-time copy inputs of every block: for the block at anchor a of row i, what an index over
    input_ids[i, : a + 1] gives (the text up to and including the anchor, as at decoding time).
    input_ids [b, S], anchors [b, N] -> (candidates [b, N, n], matched lengths [b, N], records [b, N, 2])."""
    out = []
    for seq, anc in zip(input_ids.tolist(), anchors.tolist()):
        ix = copy_index(min_ngram)
        per = {}
        for a in sorted(set(anc)):
            ix.extend(seq[len(ix.seq): a + 1])
            per[a] = _inputs(ix, n)
        out.append([per[a] for a in anc])
    return _as_tensors(out, input_ids.device)
