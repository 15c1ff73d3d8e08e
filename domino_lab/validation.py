"""Checks of the values a user gives (CLI flags, config fields, dashboard inputs).

Each failed check is one `UserError` naming the value and what is allowed, raised before any work starts; the
config dataclasses, the CLIs, the engine and the dashboard all ask these, so every entry point says the same.
"""
from __future__ import annotations

import math
import numbers
import secrets

from .errors import UserError

SEED_MAX = (1 << 64) - 1          # torch generators take unsigned 64-bit seeds
TRAIN_SEED_MAX = (1 << 32) - 1    # seed_everything also seeds numpy, which takes 32-bit seeds


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)     # (numpy integers too)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def fresh_seed() -> int:
    """A seed for a call that was given none, drawn from the OS: `torch.seed()` would also reseed torch's global
    stream, so a caller's `torch.manual_seed` would no longer fix what it draws after the call."""
    return secrets.randbits(63)


def check_seed(seed, name: str = "seed", high: int = SEED_MAX) -> int:
    if not _is_int(seed) or not 0 <= seed <= high:
        raise UserError(f"{name} must be a whole number between 0 and {high}, got {seed!r}")
    return int(seed)          # (torch generators take a Python int, not a numpy integer)


# torch.set_num_threads takes a C int, and a count beyond it fails with an overflow deep in torch; no machine this
# project meets has more cores than this
MAX_THREADS = 4096


def check_threads(n, name: str = "--threads") -> int:
    """A torch thread count as given by a user: a whole number from 1 to MAX_THREADS."""
    return check_int(n, name, 1, MAX_THREADS, what=" (torch threads)")


def check_int(value, name: str, low: int | None = None, high: int | None = None, what: str = "") -> int:
    """`value` is a whole number in [low, high] (either bound None: open); `what` adds what the value means."""
    ok = _is_int(value) and (low is None or value >= low) and (high is None or value <= high)
    if not ok:
        rng = (f">= {low}" if high is None else f"<= {high}" if low is None else f"between {low} and {high}")
        raise UserError(f"{name} must be a whole number {rng}{what}, got {value!r}")
    return int(value)


def check_number(value, name: str, low: float | None = None, high: float | None = None,
                 low_open: bool = False, high_open: bool = False) -> float:
    """`value` is a finite number in the interval given (open ends with low_open / high_open)."""
    ok = _is_number(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        lo = "" if low is None else f"{'(' if low_open else '['}{low}"
        hi = "" if high is None else f"{high}{')' if high_open else ']'}"
        rng = f"in {lo or '(-inf'}, {hi or 'inf)'}"
        raise UserError(f"{name} must be a number {rng}, got {value!r}")
    return float(value)


def check_drafter(drafter, target=None) -> None:
    """A decoder's drafter is a loaded drafter or None (plain decoding), not a name or a path; given the target being
    decoded, the drafter is bound to that very target (it reads its embeddings and LM head, and a drafter loaded for
    another Target object, say in another dtype, would fail deep inside a matmul)."""
    if drafter is not None and not (hasattr(drafter, "config") and hasattr(drafter, "options")):
        raise UserError(f"drafter must be a loaded drafter (domino_lab.models.load_drafter(name_or_dir, target)) or None, "
                        f"got {type(drafter).__name__} {drafter!r:.60}")
    if drafter is not None and target is not None and getattr(drafter, "_target", None) is not target:
        raise UserError("the drafter is bound to another Target object than the one being decoded; load it for this "
                        "target (domino_lab.models.load_drafter(name_or_dir, target)) or call drafter.bind(target)")


def check_token_ids(ids, vocab_size: int, what: str = "the prompt") -> list[int]:
    """Prompt token ids as a list of ints, each a row of the target's embedding: [0, vocab_size). Integral floats and
    tensor / numpy elements are taken; anything else is one error naming the first bad id."""
    out = []
    if hasattr(ids, "tolist"):          # a tensor or array: its elements as Python numbers, in one call
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise UserError(f"{what} must be a list of token ids, got {type(ids).__name__} {ids!r:.40}")
    for t in ids:
        try:
            v = int(t)
            ok = v == t and not isinstance(t, bool) and 0 <= v < vocab_size
        except (TypeError, ValueError, OverflowError):
            ok = False
        if not ok:
            raise UserError(f"{what} has token id {t!r}; ids must be whole numbers from 0 to {vocab_size - 1} "
                            "(the target's vocabulary)")
        out.append(v)
    return out


def check_device(device) -> "torch.device":
    """A torch device this machine has: 'cpu', 'cuda', 'cuda:1', 'mps', ..."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise UserError(f"unknown device {str(device)!r}; use cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"device {str(device)!r}: CUDA is not available on this machine (torch "
                            f"{torch.__version__}, {'a CPU-only build' if torch.version.cuda is None else 'no GPU'}"
                            "); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UserError(f"device {str(device)!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise UserError(f"device {str(device)!r}: MPS is not available on this machine; use --device cpu")
    return dev
