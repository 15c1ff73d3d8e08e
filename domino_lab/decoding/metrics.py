"""The one aggregator of step records: τ, its histogram, acceptance per draft position and draft/verify time.

Training (val/tau), evaluation, the bench, the experiments, the sweep and the dashboard all count through
`StepTally`, so a number means the same everywhere:
- τ = committed tokens / verify steps, pooled over every step (each step weighs the same; the prefill's first
  token is not a step);
- acceptance at position i = accepted at i / steps that reached i (all earlier drafts accepted); a position no
  step reached is None (not 0: nothing was measured there);
- draft / verify ms = mean per verify step.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from .records import StepRecord


def speedup_bound(tau: float, t_step: float, t_draft: float, t_verify: float) -> float:
    """The speculative cost model: τ tokens per (draft + verify) step against one token per plain step of t_step
    (any one time unit; per sequence). What the engine delivers when it adds nothing: the bench's bound, the
    sweep's speedup estimate and the regime map all use it."""
    return tau * t_step / (t_draft + t_verify)


class StepTally:
    def __init__(self, num_drafts: int = 0):
        self.steps = 0
        self.committed = 0
        self.hist: Counter = Counter()
        self.reached = [0] * num_drafts
        self.accepted = [0] * num_drafts
        self.draft_s = 0.0
        self.verify_s = 0.0

    def add(self, steps: Iterable[StepRecord]) -> "StepTally":
        for s in steps:
            n = s.acceptance_length
            self.steps += 1
            self.committed += n
            self.hist[n] += 1
            self.draft_s += s.draft_time_s
            self.verify_s += s.verify_time_s
            if len(s.draft_tokens) > len(self.reached):
                grow = len(s.draft_tokens) - len(self.reached)
                self.reached += [0] * grow
                self.accepted += [0] * grow
            # the drafts the target judged: the accepted ones and the first rejected one, except after an accepted
            # EOS (bonus None), where the text ended and the drafts after it were never judged
            for i in range(min(len(s.draft_tokens), s.accepted + (s.bonus is not None))):
                self.reached[i] += 1
                self.accepted[i] += int(i < s.accepted)
        return self

    def merge(self, other: "StepTally") -> "StepTally":
        self.steps += other.steps
        self.committed += other.committed
        self.hist.update(other.hist)
        width = max(len(self.reached), len(other.reached))
        self.reached = [a + b for a, b in zip(_pad(self.reached, width), _pad(other.reached, width))]
        self.accepted = [a + b for a, b in zip(_pad(self.accepted, width), _pad(other.accepted, width))]
        self.draft_s += other.draft_s
        self.verify_s += other.verify_s
        return self

    @property
    def tau(self) -> float | None:
        return self.committed / self.steps if self.steps else None

    @property
    def accept_pos(self) -> list[float | None]:
        return [a / r if r else None for a, r in zip(self.accepted, self.reached)]

    @property
    def draft_ms(self) -> float | None:
        return 1000 * self.draft_s / self.steps if self.steps else None

    @property
    def verify_ms(self) -> float | None:
        return 1000 * self.verify_s / self.steps if self.steps else None

    def summary(self) -> dict:
        return {"tau": self.tau, "steps": self.steps, "tau_hist": dict(sorted(self.hist.items())),
                "accept_pos": self.accept_pos, "draft_ms": self.draft_ms, "verify_ms": self.verify_ms}


def _pad(xs: list[int], n: int) -> list[int]:
    return xs + [0] * (n - len(xs))
