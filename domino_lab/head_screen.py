"""The target's greedy token, exactly, from half the bytes of its LM head.

On a CPU a decoding step of a small or mid-sized target reads every weight once, and the LM head is a large share
of them (8 of the embedded target's 27 MB; 0.6 of the 2.4 GB a Qwen3-0.6B step reads in float32). Greedy
decoding needs only the argmax of each row's logits, not the logits. `ArgmaxScreen` reads a half-precision copy
of the head instead (half the bytes; float32 accumulation inside the kernel), bounds how far every approximate
logit of a row can be from the float32 one, and computes in float32 only the tokens within twice that bound of
the row's best approximate logit: almost always the winner alone, and then nothing is recomputed. The result is
the argmax of the float32 logits (docs/design.md#greedy-head-screen).

Why the bound holds, for a hidden row h (float32), head rows w_i, their half-precision roundings h', w'_i, and a_i
the kernel's result rounded to half precision (unit roundoff u), with float32 accumulation over H terms
(γ = H · 2^-24, first order, doubled below):
    |h·w_i - h'·w'_i|  <=  ||h - h'|| ||w_i|| + ||h'|| ||w_i - w'_i||         (Cauchy-Schwarz, twice)
    |a_i - fl32(h'·w'_i)| <= 2u |a_i|,     |fl32(h'·w'_i) - h'·w'_i| <= γ ||h'|| ||w'_i||
and the float32 logit that the full head computes is itself within γ ||h|| ||w_i|| of h·w_i. Taking the maximum
of each row norm over the vocabulary gives one bound B per hidden row; every token whose float32 logit could be the
largest has a_i >= max_j a_j - 2B. B is taken 1.25 times over, so rounding in its own arithmetic cannot matter.

Which half precision: a one-row product (a plain step) runs fastest in float16 on the CPU the screen was built on,
whose 32 MB L3 did not hold the head (0.4 ms for the embedded head, against 1.3 ms in float32 and 0.8 ms in
bfloat16), a product of several rows (a verify) in bfloat16 (float16 has no fast multi-row kernel there);
float16's finer rounding also gives the tighter bound.

Whether it pays depends on the machine: where the head's float32 weights come from a cache large enough to hold
them, the full product is quicker than the half-precision one plus the bound (0.33 against 0.60 ms for one row on
a CPU with 300 MB of L3). `pays` times both on the first rows of each kind of call and keeps the faster; a plain
step's one row keeps the screen unless the full head is clearly faster (docs/design.md#greedy-head-screen).
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from .models.packed_linear import PackedLinear, mode

SAFETY = 1.25
TIMING_ROUNDS = 7       # interleaved calls of each read when `pays` times them
MARGIN = 0.97           # the screen is used where it takes less than this share of the full head's time
# ... and for one-row calls (plain steps) where it takes less than this share: a plain step then reads half the bytes,
# which leaves more of the cache to the layers' weights than a timing of the head alone can show (with the full head
# read through oneDNN's packed product, tied with the screen in isolation, decoding ran 5-8% faster with the screen)
ONE_ROW_MARGIN = 1.1
UNIT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


class _HalfHead:
    """A half-precision copy of the head and the constants of its bound."""

    def __init__(self, w: torch.Tensor, dtype: torch.dtype):
        self.dtype, self.u = dtype, UNIT_ROUNDOFF[dtype]
        self.w = w.to(dtype)
        wh = self.w.float()
        gamma = 2.0 * w.shape[1] * 2.0 ** -24
        max_w = float(w.norm(dim=1).max())
        # B = ||h - h'|| · c_dh + ||h'|| · c_h + (||h'|| + ||h - h'||) · c_full + 2u · max|a|
        self.c_dh = max_w
        self.c_h = float((w - wh).norm(dim=1).max()) + gamma * float(wh.norm(dim=1).max())
        self.c_full = gamma * max_w


class ArgmaxScreen:
    """argmax(h @ W.T) for a float32 head W [V, H], read from a half-precision copy; exact (module docstring)."""

    def __init__(self, weight: torch.Tensor, full=None):
        self.w = weight.detach()
        # the full head's read that the screen competes with (the head module: it may take oneDNN's packed product,
        # models/packed_linear.py)
        self.full = full if full is not None else (lambda h: F.linear(h, self.w))
        self._halves: dict[torch.dtype, _HalfHead] = {}
        self._pays: dict[tuple, bool] = {}   # kind of call (see `pays`) -> whether the screen is the faster read

    @classmethod
    def for_head(cls, head: nn.Module) -> "ArgmaxScreen | None":
        """A screen for a plain bias-free float32 linear head on a CPU; None where it would not pay (GPUs and
        low-precision targets already read half-precision weights) or does not apply (a bias, another module)."""
        w = getattr(head, "weight", None)
        if (type(head) not in (nn.Linear, PackedLinear) or head.bias is not None or w is None
                or w.dtype != torch.float32 or w.device.type != "cpu"):
            return None
        return cls(w, head)

    def reads(self, weight: torch.Tensor) -> bool:
        """Whether this screen was built from `weight` as it is now (a model moved to another device or dtype
        after loading has new weight storage, and the copies would be stale)."""
        return weight.data_ptr() == self.w.data_ptr() and weight.dtype == self.w.dtype

    def half_for(self, rows: int) -> _HalfHead:
        """The copy a product of `rows` rows reads (built on first use)."""
        dtype = torch.float16 if rows == 1 else torch.bfloat16
        if dtype not in self._halves:
            self._halves[dtype] = _HalfHead(self.w, dtype)
        return self._halves[dtype]

    @torch.no_grad()
    def pays(self, h: torch.Tensor) -> bool:
        """Whether the screen reads the argmax of rows like h [..., H] faster than the full head on this machine.
        Timed once per kind of call (one row, the float16 copy; 2-16 rows, a verify; more, a tree or a prefill), on
        the first rows of that kind: TIMING_ROUNDS calls of each read, interleaved, medians of thread time (of wall time
        with several torch threads); kept where it takes less than MARGIN of the full head's time (ONE_ROW_MARGIN for
        one row). Either read gives the float32 head's argmax, so a choice that timing noise tips the wrong way costs
        time only."""
        h = h.reshape(-1, h.shape[-1])
        # (and per linear kernel mode: the full head's read is oneDNN's packed product or MKL's)
        kind = (1 if h.shape[0] == 1 else 2 if h.shape[0] <= 16 else 3, mode())
        if kind not in self._pays:
            reads = {"full": lambda: self.full(h).argmax(-1), "screen": lambda: self.argmax(h)}
            times: dict[str, list[float]] = {k: [] for k in reads}
            for f in reads.values():      # warm-up (the screen builds its half-precision copy)
                f()
            # thread time ignores other processes on the cores, but with several torch threads it would miss the
            # full product's work on the others and favour it
            clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
            for _ in range(TIMING_ROUNDS):
                for k, f in reads.items():
                    t0 = clock()
                    f()
                    times[k].append(clock() - t0)
            margin = ONE_ROW_MARGIN if kind[0] == 1 else MARGIN
            self._pays[kind] = statistics.median(times["screen"]) < margin * statistics.median(times["full"])
        return self._pays[kind]

    def decisions(self) -> dict[str, str]:
        """The reads `pays` chose so far under the current linear kernel mode: {"1 row" | "2-16 rows" | "more rows":
        "screen" or "full"} (a record of a run: the choice is timed per process)."""
        names = {1: "1 row", 2: "2-16 rows", 3: "more rows"}
        return {names[k]: "screen" if v else "full" for (k, m), v in sorted(self._pays.items()) if m == mode()}

    @staticmethod
    def bound(h: torch.Tensor, hh: torch.Tensor, approx: torch.Tensor, half: _HalfHead) -> torch.Tensor:
        """B per row [R, 1]: no approximate logit of the row is further than B from its float32 logit (module
        docstring). h [R, H] float32, hh its half-precision rounding, approx the half-precision product [R, V]."""
        hhf = hh.float()
        n_h = hhf.norm(dim=-1, keepdim=True)
        n_dh = (h - hhf).norm(dim=-1, keepdim=True)
        big = torch.maximum(approx.amax(-1, keepdim=True).abs(), approx.amin(-1, keepdim=True).abs())
        return (n_dh * half.c_dh + n_h * half.c_h + (n_h + n_dh) * half.c_full + big * (2 * half.u)) * SAFETY

    @torch.no_grad()
    def argmax(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] float32 -> the index of each row's largest float32 logit [...] (the first of equal ones, as
        torch.argmax)."""
        shape = h.shape[:-1]
        h = h.reshape(-1, h.shape[-1])
        half = self.half_for(h.shape[0])
        hh = h.to(half.dtype)
        approx = F.linear(hh, half.w).float()                                        # [R, V]
        floor = approx.amax(-1, keepdim=True) - 2 * self.bound(h, hh, approx, half)
        if not torch.isfinite(floor).all():           # inf/nan in a row: no bound to trust, read the full head
            return F.linear(h, self.w).argmax(-1).reshape(shape)
        rows, cols = (approx >= floor).nonzero(as_tuple=True)
        if rows.numel() == h.shape[0]:                # one candidate per row: it is the argmax
            return cols.reshape(shape)
        exact = torch.full_like(approx, float("-inf"))
        exact[rows, cols] = (h[rows] * self.w[cols]).sum(-1)
        return exact.argmax(-1).reshape(shape)
