"""On-disk cache of built datasets (Arrow, via `Dataset.save_to_disk`), keyed by a fingerprint.

A dataset is rebuilt only when its fingerprint (a hash of everything it was built from) changes;
the build is written to a temporary folder and renamed into place, so an interrupted build never
leaves a half-written cache entry behind.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import datasets

from domino_lab.errors import UserError

CACHE_ENV = "DOMINO_LAB_CACHE"


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache folder: `cache_dir`, else $DOMINO_LAB_CACHE, else ~/.cache/domino_lab; checked writable."""
    root = Path(cache_dir or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "domino_lab").expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
        # mkdir succeeds on an existing read-only folder, so probe with a real write.
        with tempfile.NamedTemporaryFile(dir=root, prefix=".probe-"):
            pass
    except OSError as e:
        raise UserError(
            f"cache directory {root} is not writable ({e.strerror}); "
            f"pass a writable cache_dir or set {CACHE_ENV}"
        ) from None
    return root


def fingerprint(**parts) -> str:
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def cached_dataset(name: str, key: str, build: Callable[[], datasets.Dataset],
                   cache_dir: str | os.PathLike | None = None) -> datasets.Dataset:
    """Load `name-key` from the cache, or build, save atomically and load it. An empty build is returned as is:
    `datasets` saves a dataset without rows as zero shards that it cannot load back, and it costs nothing to redo."""
    root = cache_root(cache_dir)
    final = root / f"{name}-{key}"
    if not (final / "dataset_info.json").exists():
        ds = build()
        if len(ds) == 0:
            return ds
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        try:
            ds.save_to_disk(str(tmp))
            try:
                os.replace(tmp, final)
            except OSError:
                # another process finished the same build first; its copy is equally valid
                if not (final / "dataset_info.json").exists():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return datasets.load_from_disk(str(final))
