"""Offline target features: the tapped hidden states of every training sequence, computed once, stored as fp16
safetensors shards and memory-mapped, so a training step runs only the drafter (docs/design.md#data-flow).

A cache is keyed by what determines its content: the target's weights digest, shape and compute dtype, the tapped
layers, the storage dtype and the token ids of every sequence. Another target, other taps or other data get another
folder; nothing is ever reused across them. The online path (the target's forward inside every step) stays for GPUs
and for data too large to store: `data.features: online`.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..errors import UserError, file_lock
from ..models.weights_file import safetensors_shapes

VERSION = 1
SHARD_BYTES = 256 << 20
INDEX = "index.json"


def cache_key(target, taps: list[int], rows: list[dict], dtype: str = "float16") -> str:
    # the compute dtype too: the weights digest can be the same for a float16 and a float32 load of one target,
    # whose features differ by more than the float16 storage rounds away
    h = hashlib.sha256(json.dumps({"version": VERSION, "target": target.weights_digest, "shape": target.fingerprint,
                                   "compute_dtype": str(target.dtype).removeprefix("torch."),
                                   "taps": list(taps), "dtype": dtype}, sort_keys=True).encode())
    for r in rows:
        h.update(str(r["id"]).encode() + b"\0")
        h.update(torch.tensor(r["input_ids"], dtype=torch.int32).numpy().tobytes())
    return h.hexdigest()[:16]


class FeatureCache:
    """Read side: `cache[row_id]` -> [len, n_taps * H] fp16, sliced lazily out of memory-mapped shards."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            index = json.loads((self.path / INDEX).read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"feature cache {self.path} is unreadable ({e}); delete the folder to rebuild it") from None
        self.width, self.rows, self.shards = self._checked(index)
        self._open: dict[int, object] = {}

    def _checked(self, index) -> tuple[int, dict, list]:
        """The index's width, rows and shards, once every shard is whole and every row lies inside its shard: a cache
        cut short (a full disk, an interrupted copy) is one error here rather than a traceback inside a training
        step. Reads only the shards' headers."""
        def damaged(what: str) -> UserError:
            return UserError(f"feature cache {self.path} is damaged ({what}); delete the folder to rebuild it")

        if not (isinstance(index, dict) and "width" in index and isinstance(index.get("rows"), dict)
                and isinstance(index.get("shards"), list)):
            raise damaged(f"its {INDEX} lacks width, rows or shards")
        width, rows, shards = index["width"], index["rows"], index["shards"]
        lengths = []
        for name in shards:
            file = self.path / str(name)
            if not file.is_file():
                raise damaged(f"shard {name} is missing")
            try:
                shape = safetensors_shapes(file, "").get("features")
            except UserError:
                raise damaged(f"shard {name} is cut off or corrupted") from None
            if shape is None or len(shape) != 2 or shape[1] != width:
                raise damaged(f"shard {name} holds no [tokens, {width}] features")
            lengths.append(shape[0])
        for row_id, place in rows.items():
            try:
                shard, start, length = place
                inside = 0 <= shard < len(lengths) and 0 <= start and start + length <= lengths[shard]
            except (TypeError, ValueError):
                inside = False
            if not inside:
                raise damaged(f"row {row_id!r} lies outside its shard")
        return width, rows, shards

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, row_id) -> bool:
        return str(row_id) in self.rows

    def __getitem__(self, row_id) -> torch.Tensor:
        from safetensors import safe_open

        shard, start, length = self.rows[str(row_id)]
        if shard not in self._open:
            self._open[shard] = safe_open(str(self.path / self.shards[shard]), framework="pt")
        return self._open[shard].get_slice("features")[start:start + length]

    def __getstate__(self):            # DataLoader workers reopen the shards themselves
        return {**self.__dict__, "_open": {}}


@torch.no_grad()
def build(target, rows: list[dict], taps: list[int], out: Path, batch_tokens: int = 8192,
          progress: bool = True) -> Path:
    """Run the target over `rows` (bucketed by length, right padding: causal attention keeps every real position
    blind to the pads after it) and write the features of each row's real positions, fp16, in shards."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]))
        index: dict[str, list[int]] = {}
        shards: list[str] = []
        buf: list[torch.Tensor] = []
        filled = offset = 0

        def flush():
            nonlocal buf, filled, offset
            if buf:
                name = f"features-{len(shards):05d}.safetensors"
                save_file({"features": torch.cat(buf)}, str(tmp / name))
                shards.append(name)
                buf, filled, offset = [], 0, 0

        bar = tqdm(total=sum(len(r["input_ids"]) for r in rows), unit="tok", desc="target features",
                   disable=not progress)
        i = 0
        width = None
        while i < len(order):
            n = len(rows[order[i]]["input_ids"])
            group = order[i: i + max(1, batch_tokens // max(1, n))]
            longest = max(len(rows[j]["input_ids"]) for j in group)
            ids = torch.zeros(len(group), longest, dtype=torch.long)
            for k, j in enumerate(group):
                ids[k, : len(rows[j]["input_ids"])] = torch.tensor(rows[j]["input_ids"])
            feats = target.features(ids.to(target.device), taps).to("cpu", torch.float16)
            width = feats.shape[-1]
            for k, j in enumerate(group):
                length = len(rows[j]["input_ids"])
                if filled + length * width * 2 > SHARD_BYTES:
                    flush()
                index[str(rows[j]["id"])] = [len(shards), offset, length]
                buf.append(feats[k, :length].clone())
                filled += length * width * 2
                offset += length
                bar.update(length)
            i += len(group)
        flush()
        bar.close()
        (tmp / INDEX).write_text(json.dumps({"version": VERSION, "width": width, "taps": list(taps),
                                             "target": target.weights_digest, "shards": shards, "rows": index}))
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def ensure(target, rows: list[dict], taps: list[int], root: str | os.PathLike, progress: bool = True
           ) -> FeatureCache:
    """The cache of `rows` under `root/<key>`, built on first use. Processes that ask together (DDP ranks, sweep
    workers) wait on a lock while one builds it."""
    root = Path(root)
    out = root / cache_key(target, taps, rows)
    if not (out / INDEX).exists():
        with file_lock(root / f".{out.name}.lock"):
            if not (out / INDEX).exists():
                build(target, rows, taps, out, progress=progress)
    return FeatureCache(out)
