"""The two offline training domains of the embedded default target (docs/design.md#embedded-default), as `datasets`.

- code: the Python standard-library source of the running interpreter (tests, IDLE, turtledemo,
  site-packages and the generated pydoc topic dump excluded), deduplicated by content, with ~5% of
  files held out by a stable hash of their relative path.
- math: GSM8K-style problems from `math_gen`, train seeds vs a disjoint held-out seed range.

Both are cached as Arrow under the cache dir and rebuilt only when their inputs change.
"""
from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from pathlib import Path

import datasets
from tqdm.auto import tqdm

from domino_lab.data import math_gen
from domino_lab.data.cache import cached_dataset, fingerprint
from domino_lab.data.math_gen import (MATH_HELDOUT_SEEDS, MATH_TRAIN_SEEDS, format_prompt,
                                      format_text, generate_problem)
from domino_lab.errors import UserError

SPLITS = ("train", "heldout")

# Folders never used as code data: test suites (`test*` folders, incl. idlelib/idle_test),
# GUI demos, third-party packages, and pydoc_data (a generated dump of documentation prose).
_EXCLUDED_DIRS = {"idlelib", "turtledemo", "site-packages", "dist-packages", "pydoc_data", "__pycache__"}
CODE_HELDOUT_PERCENT = 5
CODE_CORPUS_VERSION = "1"

DEFAULT_MATH_N = {"train": 250_000, "heldout": 2_000}


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")


def _excluded(rel: Path) -> bool:
    for part in rel.parts[:-1]:
        if part in _EXCLUDED_DIRS or part.startswith("test") or part == "idle_test":
            return True
    return False


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_code_files(root: Path | None = None) -> list[Path]:
    """Relative paths of the stdlib `.py` files used as code data, in a deterministic order."""
    root = root or stdlib_dir()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        # prune excluded folders so os.walk never descends into them
        dirnames[:] = sorted(d for d in dirnames if not _excluded(rel_dir / d / "x.py"))
        out.extend(rel_dir / f for f in filenames if f.endswith(".py"))
    return sorted(out, key=lambda p: p.as_posix())


def is_heldout_path(rel: str) -> bool:
    """Stable (hash-based, not random) split so a file keeps its split across runs and machines."""
    h = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:4], "big")
    return h % 100 < CODE_HELDOUT_PERCENT


def _build_code(root: Path, files: list[Path], split: str) -> datasets.Dataset:
    ids, texts = [], []
    seen: set[str] = set()
    for rel in tqdm(files, desc="reading stdlib source", unit="file"):
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few files use legacy encodings; skipping them keeps the corpus plain UTF-8
        if not text.strip():
            continue  # empty __init__.py files teach nothing
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest in seen:
            continue  # dedupe before splitting so one content can never sit in both splits
        seen.add(digest)
        rel_s = rel.as_posix()
        if is_heldout_path(rel_s) == (split == "heldout"):
            ids.append(rel_s)
            texts.append(text)
    return datasets.Dataset.from_dict({"id": ids, "text": texts})


def _code_inputs() -> tuple[Path, list[Path]]:
    root = stdlib_dir()
    files = list_code_files(root)
    if not files:
        raise UserError(f"no Python standard-library source found under {root}")
    return root, files


def code_corpus_key(split: str = "train") -> str:
    """Fingerprint of everything the code split is built from (rebuild when any of it changes)."""
    _check_split(split)
    root, files = _code_inputs()
    file_list = hashlib.sha256(
        "\n".join(f"{p.as_posix()}:{(root / p).stat().st_size}" for p in files).encode()).hexdigest()
    return fingerprint(kind="code", version=CODE_CORPUS_VERSION, stdlib=str(root), python=sys.version,
                       files=file_list, split=split, heldout_percent=CODE_HELDOUT_PERCENT)


def load_code_corpus(split: str = "train", cache_dir=None) -> datasets.Dataset:
    """Stdlib source files of the running interpreter; columns `id` (relative path) and `text`."""
    key = code_corpus_key(split)
    root, files = _code_inputs()
    return cached_dataset(f"code-{split}", key, lambda: _build_code(root, files, split), cache_dir)


def math_seeds(split: str, n: int | None = None) -> range:
    _check_split(split)
    full = MATH_TRAIN_SEEDS if split == "train" else MATH_HELDOUT_SEEDS
    n = DEFAULT_MATH_N[split] if n is None else n
    if not 0 < n <= len(full):
        raise UserError(f"math corpus size n={n} must be between 1 and {len(full)}")
    return full[:n]


def _build_math(seeds: range) -> datasets.Dataset:
    cols: dict[str, list] = {k: [] for k in ("id", "seed", "question", "solution", "answer", "prompt", "text")}
    for seed in tqdm(seeds, desc="generating math problems", unit="problem"):
        p = generate_problem(seed)
        cols["id"].append(f"math/{seed}")
        cols["seed"].append(seed)
        cols["question"].append(p["question"])
        cols["solution"].append(p["solution"])
        cols["answer"].append(p["answer"])
        cols["prompt"].append(format_prompt(p))
        cols["text"].append(format_text(p))
    return datasets.Dataset.from_dict(cols)


def math_corpus_key(split: str = "train", n: int | None = None) -> str:
    seeds = math_seeds(split, n)
    return fingerprint(kind="math", version=math_gen.GENERATOR_VERSION, start=seeds.start, stop=seeds.stop,
                       module=_module_digest())


def load_math_corpus(split: str = "train", n: int | None = None, cache_dir=None) -> datasets.Dataset:
    """The first `n` problems of the split's seed range; columns id, seed, question, solution, answer,
    prompt, text (text = prompt + ' ' + solution)."""
    seeds = math_seeds(split, n)
    return cached_dataset(f"math-{split}", math_corpus_key(split, n), lambda: _build_math(seeds), cache_dir)


def _module_digest() -> str:
    # Guards against editing a template but forgetting to bump GENERATOR_VERSION: any change to the
    # generator source also invalidates cached problems.
    return hashlib.sha256(Path(math_gen.__file__).read_bytes()).hexdigest()[:16]
