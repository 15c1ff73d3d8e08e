"""Prose prompts derived from the code corpus: the openings of its comments and docstrings.

The embedded target knows Python and grade-school math. Given prose it writes text it never learned and falls into
loops of the kinds that prompts from outside its corpora drive it into, which drafters trained on its math and code
answers alone decline to copy (docs/design.md#prose-domain). `regenerate --n-prose N` has the target answer N of
these from the training split, so that its drafters see such text. A prompt is a comment's first 2-4 words after
`# `, or a docstring's first 2-5 words after its opening quotes. Deterministic for a given corpus and seed.
"""
from __future__ import annotations

import ast
import functools
import random
import re

# a comment line of prose: a letter first, 20+ characters
COMMENT = re.compile(r"^[ \t]*# ([A-Za-z][^\n]{20,})$", re.M)
DOCSTRING_OWNERS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)


def candidates(files, rng: random.Random) -> list[tuple[str, str, str]]:
    """(kind, source file, prompt) for every comment line of 5+ words and every docstring of 6+ words of `files`
    ((id, text) pairs), in file order; the opening's length is drawn from `rng`."""
    out = []
    for src, text in files:
        for m in COMMENT.finditer(text):
            words = m.group(1).split()
            if len(words) >= 5:
                out.append(("comment", src, "# " + " ".join(words[: rng.randint(2, 4)])))
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, DOCSTRING_OWNERS):
                doc = ast.get_docstring(node)
                if doc and len(doc.split()) >= 6:
                    out.append(("doc", src, '"""' + " ".join(doc.split()[: rng.randint(2, 5)])))
    return out


def prose_prompts(split: str, n: int, seed: int = 0, cache_dir=None) -> list[dict]:
    """`n` distinct prose prompts ({id, prompt, kind, source}) from the code corpus's `split` (`train` for
    regeneration; `heldout` files are evaluation ground), shuffled by `seed`."""
    return [dict(row) for row in _shuffled(split, seed, None if cache_dir is None else str(cache_dir))[:n]]


@functools.lru_cache(maxsize=4)
def _shuffled(split: str, seed: int, cache_dir: str | None) -> tuple[dict, ...]:
    """Every distinct prompt of `split` in `seed`'s order. Kept per process: parsing every file of the corpus takes
    seconds, and the result depends only on the corpus (the running interpreter's) and the seed."""
    from .corpora import load_code_corpus

    ds = load_code_corpus(split, cache_dir=cache_dir)
    rng = random.Random(seed)
    cands = candidates(zip(ds["id"], ds["text"]), rng)
    rng.shuffle(cands)
    seen, rows = set(), []
    for kind, src, prompt in cands:
        if prompt in seen:
            continue
        seen.add(prompt)
        rows.append({"id": f"prose/{len(rows)}", "prompt": prompt, "kind": kind, "source": src})
    return tuple(rows)
