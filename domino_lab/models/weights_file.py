"""Checking a safetensors file before loading it: a cut-off download or a corrupted file is one clear error naming
it, not a loader traceback half-way through. Used for drafter checkpoints in both layouts (ours and the releases')."""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError


def safetensors_shapes(weights: Path, fix: str) -> dict[str, list[int]]:
    """Tensor name -> shape of a safetensors file, read from its header after checking the file is complete (the
    header parses and the data it describes is all there), so loading it cannot fail half-way: a truncated or
    corrupted file is one UserError naming it, ending with `fix`."""
    try:
        size = weights.stat().st_size
        with open(weights, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or not 2 <= n <= size - 8:
                raise ValueError("the header is cut off")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
        shapes = {k: [int(d) for d in v["shape"]] for k, v in header.items()}
    except OSError as e:
        raise UserError(f"cannot read drafter weights {weights}: {e.strerror}; {fix}") from None
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        raise UserError(f"drafter weights {weights} are not a readable safetensors file (corrupted or cut off); "
                        f"{fix}") from None
    if 8 + n + end > size:
        raise UserError(f"drafter weights {weights} are cut off ({size} bytes, the header says "
                        f"{8 + n + end}); {fix}")
    return shapes
