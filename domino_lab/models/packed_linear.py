"""Linear layers through oneDNN's pre-packed weights, where that is measured to be faster on this CPU.

PyTorch's CPU builds run a float32 `F.linear` through MKL. On some processors MKL's small products are far from the
machine's speed: on the AMD EPYC VM this project measures on (AVX-512), the embedded target's LM head (8192 x 256)
over the 9 rows of a verify takes 1.12 ms through MKL and 0.52 ms through oneDNN with the weight reordered once into
oneDNN's blocked layout, and its MLP's products at 9 rows 0.56-0.64 of MKL's time. Products of one or two rows of a
small weight go the other way (oneDNN's call costs ~10 µs more to set up: 16 against 5 µs for 256 x 256 at one row),
so the choice depends on the rows of a call as well as on the processor (experiments/results/packed_linears/).

`PackedLinear` (an `nn.Linear` whose class `use_packed` swaps in; parameters, state dict and tied weights unchanged)
and `linear` (for a weight that is no module's) time both products once per process and weight shape at 1, 8 and
64 rows, and take the packed one for calls of more rows than the largest of those where it loses (`min_rows`). The
packed copy is made at the first call that uses it and made again when the weight changes (an optimiser step bumps
its version; a move gives it new storage); it is kept beside the module, not in it, so copying or pickling a module
never meets oneDNN's opaque tensor. A copy that would leave less than a quarter of the machine's memory available
is not made (that weight keeps MKL's product): the copies double the memory of the weights that take them. Calls
that autograd records (training), that torch.compile traces, or that are not float32 on a CPU take `F.linear`.
The environment variable DOMINO_LAB_LINEARS sets the mode for a process: `auto` (the default), `onednn` (the packed
product for every call it can take) or `aten` (never).

The two kernels sum in different orders, so their results differ in the last bits, as MKL's one-row and many-row
products already do: greedy verification stays exact because a plain step and a verify each read the argmax of the
target's logits as that call computes them, and losslessness is tested under every mode (docs/design.md#packed-linears).
"""
from __future__ import annotations

import functools
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import UserError

# rows of the calls a decode makes: a plain step; a block, a verify or a draft pass; a tree, a batch or a prompt
TIMING_ROWS = (1, 8, 64)
TIMING_ROUNDS = 7          # interleaved timings of each kernel at each row count
TIMING_S = 2e-4            # wall time each timing aims at
MAX_CALLS = 64
MARGIN = 0.9               # the packed kernel is used where it takes less than this share of MKL's time
RESERVE = 0.25             # no packed copy that would leave less than this share of the machine's memory available
NEVER = 1 << 62

# "auto": measured per weight shape; "onednn": the packed kernel for every call it can take; "aten": never
MODES = ("auto", "onednn", "aten")
ENV = "DOMINO_LAB_LINEARS"
_mode: str | None = None   # None: read ENV at the first call
_generation = 0            # counts set_mode calls: a module's kept choice is of one mode
_min_rows: dict[tuple, int] = {}                # (out, in, bias) -> the fewest rows a packed call pays at
_packed: WeakIdKeyDictionary = WeakIdKeyDictionary()   # weight -> (version, data pointer, packed copy)


@functools.cache
def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def set_mode(m: str) -> None:
    """'auto' (the default), 'onednn' or 'aten', for every packed linear of the process (tests and A/B timing)."""
    global _mode, _generation
    if m not in MODES:
        raise ValueError(f"unknown linear kernel mode {m!r}; use one of {', '.join(MODES)}")
    _mode, _generation = m, _generation + 1


def mode() -> str:
    """The process's mode: set_mode's, else DOMINO_LAB_LINEARS's (checked at the first call), else auto."""
    global _mode
    if _mode is None:
        m = os.environ.get(ENV, "").strip().lower() or "auto"
        if m not in MODES:
            raise UserError(f"{ENV}={os.environ[ENV]!r} is not a linear kernel mode; set it to one of "
                            f"{', '.join(MODES)}, or unset it for auto")
        _mode = m
    return _mode


def _version(w: torch.Tensor) -> int:
    """The weight's version counter; -1 for a weight made under torch.inference_mode, which keeps none (and cannot
    be changed in place outside it)."""
    return -1 if w.is_inference() else w._version


def memory() -> tuple[int, int] | None:
    """(available, total) bytes of the machine's memory, from /proc/meminfo; None where that cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()}
        return info["MemAvailable"], info["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError):
        return None


def _room_for(nbytes: int) -> bool:
    """Whether a packed copy of `nbytes` leaves at least RESERVE of the machine's memory available. A copy doubles
    its weight's memory: a float32 target that takes most of the memory on its own would otherwise be pushed out of
    it by its own verifies."""
    m = memory()
    return m is None or m[0] - nbytes >= RESERVE * m[1]


def _pack(w: torch.Tensor) -> torch.Tensor | None:
    """The packed copy of `w` as it is now (None: no room for one, see `_room_for`)."""
    entry = _packed.get(w)
    if entry is None or entry[0] != _version(w) or entry[1] != w.data_ptr():
        _packed.pop(w, None)                 # (a stale copy is freed before the room for its successor is judged)
        packed = (torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
                  if _room_for(w.numel() * w.element_size()) else None)
        entry = _packed[w] = (_version(w), w.data_ptr(), packed)
    return entry[2]


def _packed_call(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    packed = _pack(w)
    if packed is None:
        return F.linear(x, w, b)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, b, "none", [], "")


def time_products(w: torch.Tensor, b: torch.Tensor | None, rows: int, rounds: int = TIMING_ROUNDS,
                  g: torch.Generator | None = None) -> dict[str, float]:
    """Seconds per call of MKL's product ("aten") and the packed one ("packed") of `w` over `rows` random rows:
    medians of wall time over `rounds` interleaved rounds (thread time would miss the work of a product's other
    OpenMP threads), each round timing enough calls for ~TIMING_S of MKL's product (a one-row product of a small
    weight takes a few µs, not much more than reading the clock), one call for a large weight."""
    x = torch.randn(rows, w.shape[1], generator=g)
    reads = {"aten": lambda: F.linear(x, w, b), "packed": lambda: _packed_call(x, w, b)}
    times: dict[str, list[float]] = {k: [] for k in reads}
    with torch.no_grad():
        for f in reads.values():       # warm-up (packs the weight)
            f()
        t0 = time.perf_counter()
        reads["aten"]()
        calls = max(1, min(MAX_CALLS, int(TIMING_S / max(time.perf_counter() - t0, 1e-7))))
        for _ in range(rounds):
            for k, f in reads.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    f()
                times[k].append((time.perf_counter() - t0) / calls)
    return {k: statistics.median(v) for k, v in times.items()}


def _measure(w: torch.Tensor, b: torch.Tensor | None) -> int:
    """The fewest rows from which the packed product beats MKL's for this weight's shape (NEVER: at no row count),
    timed at each of TIMING_ROWS rows (`time_products`): the packed product is taken from just above the largest row
    count where it loses. Both give the same product to rounding, so a choice that noise tips the wrong way costs
    time only."""
    g = torch.Generator().manual_seed(0)
    loses_at = 0
    for rows in TIMING_ROWS:
        t = time_products(w, b, rows, g=g)
        if t["packed"] >= MARGIN * t["aten"]:
            loses_at = rows
    return NEVER if loses_at == TIMING_ROWS[-1] else loses_at + 1


def min_rows(w: torch.Tensor, b: torch.Tensor | None) -> int:
    """The fewest rows of a call that takes the packed product of `w` under the current mode (NEVER: none)."""
    if mode() == "aten" or w.dtype != torch.float32 or w.device.type != "cpu" or not available():
        return NEVER
    if _mode == "onednn":
        return 1
    key = (w.shape[0], w.shape[1], b is not None)
    if key not in _min_rows:
        _min_rows[key] = _measure(w, b)
    return _min_rows[key]


def shape_name(out_features: int, in_features: int, bias: bool = False) -> str:
    """How records name a weight shape: 'OUTxIN', '+bias' where the layer has one."""
    return f"{out_features}x{in_features}{'+bias' if bias else ''}"


def choices() -> dict:
    """What this process decided so far: {"mode": the mode, "packed_from": {shape_name: the fewest rows a call
    takes the packed product at, or None for never}} for every weight shape `auto` has measured (records of a run,
    e.g. the bench's: the choice depends on the machine and can differ between processes where the kernels are
    close)."""
    return {"mode": mode(), "packed_from": {shape_name(*k): (None if r == NEVER else r)
                                            for k, r in sorted(_min_rows.items())}}


def describe(c: dict) -> str:
    """One line for a `choices()` record: 'auto (oneDNN packed: 8192x256 from 1 row; MKL: 256x256)'."""
    if c["mode"] != "auto":
        return c["mode"]
    packed = [f"{k} from {r} row{'s' if r > 1 else ''}" for k, r in c["packed_from"].items() if r is not None]
    aten = [k for k, r in c["packed_from"].items() if r is None]
    parts = ([f"oneDNN packed: {', '.join(packed)}"] if packed else []) + ([f"MKL: {', '.join(aten)}"] if aten else [])
    return "auto" + (f" ({'; '.join(parts)})" if parts else "")


def _takes_packed(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether a call whose rows pay for the packed product can take it."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and w.dtype == torch.float32
            and w.device.type == "cpu" and not (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad)))


def _product(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, first: int) -> torch.Tensor:
    """The packed product where the call has at least `first` rows and can take it, else F.linear."""
    if x.dim() == 0 or x.numel() < first * x.shape[-1] or not _takes_packed(x, w):
        return F.linear(x, w, b)
    return _packed_call(x, w, b)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, b), through oneDNN's packed weight where this call's rows pay for it (module docstring)."""
    if torch.compiler.is_compiling():
        return F.linear(x, w, b)
    return _product(x, w, b, min_rows(w, b))


class PackedLinear(nn.Linear):
    """nn.Linear whose forward is `linear` (module docstring), with its weight shape's choice kept on the module:
    a decode calls the embedded target's 42 linear layers every step, most with one row, where looking the
    choice up again would cost a tenth of what the product does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return F.linear(x, self.weight, self.bias)
        first = self.__dict__.get("_packed_from")
        if first is None or first[0] != _generation:
            first = self._packed_from = (_generation, min_rows(self.weight, self.bias))
        return _product(x, self.weight, self.bias, first[1])


def use_packed(module: nn.Module) -> int:
    """Swap every plain nn.Linear of `module` (itself included) for a PackedLinear in place; returns how many. The
    modules keep their parameters, so tied weights stay tied and state dicts are unchanged. A bad
    DOMINO_LAB_LINEARS fails here, before the module decodes anything."""
    mode()
    n = 0
    for m in module.modules():
        if type(m) is nn.Linear:
            m.__class__ = PackedLinear
            n += 1
    return n
