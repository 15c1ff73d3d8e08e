"""Drafting by copying: the continuation of the latest earlier occurrence of the text's own suffix.

A model drafter predicts; it does not copy. Small targets (and large ones on code) fall into loops and quote their
prompt, and then the next tokens are already in the context: prompt lookup (an n-gram copier) drafts them exactly,
where a trained drafter keeps guessing its training prior (docs/design.md#lookup-drafting). The engine asks
`NgramLookup.propose` before every step and, when the suffix match is long enough, verifies the copy instead of
calling the drafter (which then skips that step: its context catches up at the next call); `update` after it.
"""
from __future__ import annotations

MAX_NGRAM = 16      # longest suffix matched; longer matches are tried first (they are the most reliable)


class NgramLookup:
    """An index from every n-gram (min_ngram ≤ n ≤ MAX_NGRAM) of the sequence so far to the position right after
    its latest occurrence, kept up to date token by token (O(MAX_NGRAM) per token, no rescans)."""

    def __init__(self, min_ngram: int, tokens: list[int] = (), adaptive: bool = True):
        if min_ngram < 1:
            raise ValueError("min_ngram must be >= 1")
        self.min_ngram = min_ngram
        self.need = min_ngram              # the match length a copy currently needs (see `update`)
        self.adaptive = adaptive
        self._drafted = self._drafted_accepted = 0
        self.seq: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens) -> None:
        for t in tokens:
            self.seq.append(int(t))
            j = len(self.seq) - 1          # the n-grams ending just before j now have a continuation: seq[j]
            for n in range(self.min_ngram, min(MAX_NGRAM, j) + 1):
                self._after[tuple(self.seq[j - n: j])] = j

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
