"""How many drafts a batched verify step should check, chosen online from measured acceptance and step costs.

A verified draft costs target compute whether it is accepted or not. At batch 1 on a CPU a step is mostly weight
streaming and dispatch, so eight more positions cost little next to the tokens they commit; at batch 16 the forward
is compute-bound and every position of every row counts, so a full block can cost three plain steps while
committing two tokens per row. No fixed block length is right for both (docs/design.md#adaptive-batched-drafts).

The policy estimates, from the steps of the batch so far:
- α_i, the rate at which draft i is accepted given that the drafts before it were, on two time scales: a slow
  estimate over the whole batch (uniform prior) and a fast one over the last few drafting steps that shrinks
  back to the slow one while no draft is verified, so a bad stretch is forgotten and drafting is tried again
  when the batch as a whole says it pays; E[committed per row | n drafts] = 1 + Σ_{i≤n} Π_{j≤i} α_j;
- the cost of a step: a steady draft's time; the verify time as a line c0 + c1 · rows · (n + 1) (decayed least
  squares over the steps that verified drafts); a plain step's time on its own (cheaper than the line: one query
  per row); and the cost of a draft taking in one row's context position, which a switch from plain steps back
  to drafting pays once for every position the plain steps committed (spread over the steps left);
and verifies the n in 0..n_max that maximises rows · E[committed | n] / cost(n). The first step verifies the whole
block (every position's acceptance; its draft takes in the prompt, which gives the per-position cost), the second
one draft (a steady draft's time, a second point on the line), the next two none (a plain step's time, the
cheaper of two, so that one hiccup cannot make drafting look good for the rest of the batch); then the whole
block until eight rows have tried the first draft (at batch 1, eight steps).
"""
from __future__ import annotations

PRIOR = 2.0        # weight, in rows, of the slow estimate as the fast one's prior
EVIDENCE = 8.0     # rows that must have tried the first draft before plain steps may be chosen (acceptance is
                   # learned only while drafting: at batch 1 two unlucky first steps would otherwise end it)


def _mix(old: float | None, new: float, d: float) -> float:
    """Exponential moving average with weight d on the old value (the new one when there is none yet)."""
    return new if old is None else d * old + (1 - d) * new


class DraftCount:
    """The policy of one batched decode: `choose` before each step, `update` after it."""

    def __init__(self, n_max: int, fast: float = 0.9, slow: float = 0.99):
        self.n_max = n_max
        self.fast, self.slow = fast, slow
        # decayed counts, per draft position, of rows that reached it (every draft before it accepted) and of
        # those that accepted it: [reached, accepted] on the fast and on the slow time scale
        self.counts = {k: ([0.0] * n_max, [0.0] * n_max) for k in ("fast", "slow")}
        self.t_draft: float | None = None
        self.t_take = 0.0                  # cost of taking in one context position of one row (catch-up drafts)
        self._catch_up: list[tuple[float, int]] = []      # (draft time, rows · positions) awaiting a steady t_draft
        self._fit = [0.0] * 5              # decayed sums of w, x, y, x·x, x·y for t_verify = c0 + c1·x
        self.t_plain: tuple[float, int] | None = None    # (moving average of a plain step's time, its rows)
        self._plain_steps = 0
        self.steps = 0

    def alpha(self, i: int) -> float:
        (rs, acs), (rf, acf) = self.counts["slow"], self.counts["fast"]
        slow = (acs[i] + 1.0) / (rs[i] + 2.0)
        return (acf[i] + PRIOR * slow) / (rf[i] + PRIOR)

    def expected_committed(self, n: int) -> float:
        e, p = 1.0, 1.0
        for i in range(n):
            p *= self.alpha(i)
            e += p
        return e

    def _line(self) -> tuple[float, float] | None:
        """(c0, c1) of the verify-cost line, or None until two different position counts were timed."""
        w, x, y, xx, xy = self._fit
        var = w * xx - x * x
        if w == 0 or var <= 1e-9 * x * x:      # one position count only (up to rounding)
            return None
        c1 = max(0.0, (w * xy - x * y) / var)
        return (y - c1 * x) / w, c1

    def verify_cost(self, positions: int) -> float:
        c0, c1 = self._line()
        return c0 + c1 * positions

    def plain_cost(self, rows: int) -> float:
        """A plain step's time, moved along the line's slope from the rows it was measured at."""
        t, at = self.t_plain
        line = self._line()
        return max(0.0, t + (line[1] if line else 0.0) * (rows - at))

    def choose(self, rows: int, room: int, pending: int = 0) -> int:
        """Drafts to verify in the next step of `rows` live rows, at most `room` (the budget left); `pending` =
        context positions per row the next draft would take in."""
        cap = max(0, min(self.n_max, room))
        if cap == 0:
            return 0
        if self.steps == 0:
            return cap                     # the whole block first: every position's acceptance
        if self.t_draft is None or self._line() is None:
            return 1                       # a steady draft, timed at the cheapest verify: a second point
        if self._plain_steps < 2:
            return 0                       # two plain steps (the cheaper of them: one hiccup must not decide)
        if self.counts["slow"][0][0] < EVIDENCE:
            return cap
        catch_up = self.t_take * rows * pending if pending > self.n_max + 1 else 0.0
        c0, c1 = self._line()
        best, best_rate = 0, rows / max(self.plain_cost(rows), 1e-9)
        e, p = 1.0, 1.0
        for n in range(1, cap + 1):
            p *= self.alpha(n - 1)
            e += p                         # expected_committed(n), accumulated
            cost = self.t_draft + c0 + c1 * rows * (n + 1) + catch_up / max(1.0, room / e)
            if rows * e / cost > best_rate:
                best, best_rate = n, rows * e / cost
        return best

    def update(self, n: int, rows: int, t_verify: float, accepted: list[int] | None = None, t_draft: float = 0.0,
               taken: int = 0) -> None:
        """After a step of `rows` live rows that verified n positions past the anchor: the verify time (s) and,
        when the drafter drafted them, the accepted count of each drafted row, the draft time and the context
        positions per row the draft took in (a step that verified copied text passes accepted=None)."""
        self.steps += 1
        drafted = n > 0 and accepted is not None
        # the fast estimate ages with every drafting or plain step (so it returns to the slow one while no draft
        # is verified), the slow one only with new evidence
        for k, d, ages in (("fast", self.fast, drafted or not n), ("slow", self.slow, drafted)):
            if ages:
                reached, acc = self.counts[k]
                self.counts[k] = ([r * d for r in reached], [a * d for a in acc])
        if not n:
            # the average so far, moved along the line to this step's rows, then mixed with this step (the first
            # two: the cheaper)
            old = self.plain_cost(rows) if self.t_plain is not None else None
            mixed = _mix(old, t_verify, self.fast)
            self.t_plain = (min(old, t_verify) if old is not None and self._plain_steps < 2 else mixed, rows)
            self._plain_steps += 1
            return
        x = float(rows * (n + 1))
        self._fit = [s * self.fast + v for s, v in zip(self._fit, (1.0, x, t_verify, x * x, x * t_verify))]
        if not drafted:
            return
        for reached, acc in self.counts.values():
            for a in accepted:
                for i in range(min(n, a + 1)):
                    reached[i] += 1.0
                    acc[i] += float(i < a)
        if taken <= self.n_max + 1:
            self.t_draft = _mix(self.t_draft, t_draft, self.fast)
        else:
            self._catch_up.append((t_draft, rows * taken))
        if self.t_draft is not None:
            for t, size in self._catch_up:
                take = max(0.0, t - self.t_draft) / size
                self.t_take = _mix(self.t_take or None, take, self.fast)
            self._catch_up = []


class PlainFallback:
    """Batch-1 decoding's choice between drafting the whole block and a plain step (`choose`, then `update`).

    At one row a verified position is nearly free, so the question is not how many drafts to verify but whether
    to draft at all: a drafting step pays when it commits more tokens than a plain step would in its time,
    τ̂ · t_plain ≥ t_draft + t_verify, with τ̂ the text's recent tokens per drafting step. Drafting is the default
    and costs nothing to keep: the first WARMUP steps draft, and a plain step is timed only once τ̂ is low enough
    that drafting would lose even if a plain step cost half a verify (so a text the drafter handles well never
    pays for the measurement). While plain steps win, one drafting step every `backoff` plain steps (4, doubling
    up to 32 while the probes keep losing) checks whether the text has changed."""

    WARMUP = 4
    MAX_BACKOFF = 32

    def __init__(self, n_max: int, decay: float = 0.7):
        self.n_max, self.decay = n_max, decay
        self.tau: float | None = None          # moving average of tokens committed per drafting step
        self.t_spec: float | None = None       # ... of a steady drafting step's draft + verify time
        self.t_verify: float | None = None     # ... of its verify time alone
        self.t_plain: float | None = None      # ... of a plain step's time
        self.drafted = 0
        self.backoff = 4
        self._plain_run = 0                    # plain steps since the last drafting step

    def choose(self, room: int) -> int:
        cap = max(0, min(self.n_max, room))
        if cap == 0 or self.drafted < self.WARMUP or self.t_spec is None:
            return cap                         # (no steady drafting step timed yet: keep drafting)
        if self.t_plain is None:
            # would drafting lose even against a plain step of half a verify? then a plain step is worth timing
            return 0 if self.tau * 0.5 * self.t_verify < self.t_spec else cap
        if self.tau * self.t_plain >= self.t_spec:
            return cap
        return cap if self._plain_run >= self.backoff else 0          # a probe: has the text changed?

    def update(self, n: int, committed: int, t_draft: float, t_verify: float, drafted: bool | None = None,
               steady: bool = True) -> None:
        """After a step: n positions verified past the anchor, the tokens it committed, its times. `drafted`:
        whether the drafter ran (default n > 0; False with n > 0 = a step that verified copied text, which says
        nothing about the drafter; True with n = 0 = a draft the cutoff trimmed to nothing, still a drafting step).
        `steady` False for a draft that first took in the context of earlier plain steps (not a steady draft's
        time)."""
        drafted = n > 0 if drafted is None else drafted
        d = self.decay
        if not drafted:
            if n == 0:                         # a plain step
                self.t_plain = _mix(self.t_plain, t_verify, d)
                self._plain_run += 1
            return
        probe = self._plain_run > 0
        self.drafted += 1
        self.tau = _mix(self.tau, float(committed), d)
        if steady:
            self.t_spec = _mix(self.t_spec, t_draft + t_verify, d)
            self.t_verify = _mix(self.t_verify, t_verify, d)
        if probe and self.t_plain is not None:
            # the probe lost: wait longer before the next; it won: drafting resumes and the wait starts over
            won = self.tau * self.t_plain >= self.t_spec
            self.backoff = 4 if won else min(self.MAX_BACKOFF, 2 * self.backoff)
        self._plain_run = 0
