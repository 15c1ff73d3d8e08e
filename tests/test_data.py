"""Corpora of the embedded default target: math generator, stdlib code corpus, Arrow cache."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from domino_lab.data import corpora, math_gen
from domino_lab.data.corpora import list_code_files, load_code_corpus, load_math_corpus
from domino_lab.data.math_gen import (MATH_HELDOUT_SEEDS, MATH_TRAIN_SEEDS, format_prompt, format_text,
                                      generate_problem)
from domino_lab.errors import UserError

CALC = re.compile(r"<<([0-9+\-*/]+)=(\d+)>>(\d+)")


def _eval(expr: str) -> int:
    a, op, b = re.fullmatch(r"(\d+)([+\-*/])(\d+)", expr).groups()
    a, b = int(a), int(b)
    if op == "/":
        assert a % b == 0, f"inexact division {expr}"
        return a // b
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def test_generator_is_deterministic():
    for seed in (0, 1, 12345, MATH_HELDOUT_SEEDS.start + 7):
        assert generate_problem(seed) == generate_problem(seed)
    assert generate_problem(1) != generate_problem(2)


def test_calculations_are_correct_and_answer_matches():
    seeds = list(range(600)) + list(MATH_HELDOUT_SEEDS[:200])
    steps_seen = set()
    for seed in seeds:
        p = generate_problem(seed)
        calcs = CALC.findall(p["solution"])
        assert 2 <= len(calcs) <= 6, p
        steps_seen.add(len(calcs))
        for expr, inside, shown in calcs:
            assert _eval(expr) == int(inside) == int(shown), (seed, expr)
            assert int(shown) >= 0
        last = p["solution"].splitlines()[-1]
        assert last == f"#### {p['answer']}"
        assert isinstance(p["answer"], int)
        # the answer is the result of a calculation the solution carried out
        assert p["answer"] in {int(c[1]) for c in calcs}
    assert steps_seen >= {2, 3, 4, 5, 6}


def test_text_format():
    p = generate_problem(3)
    assert format_prompt(p) == f"Question: {p['question']}\nAnswer:"
    assert format_text(p) == format_prompt(p) + " " + p["solution"]
    assert format_text(p).endswith(f"#### {p['answer']}")


def test_generator_variety():
    qs = [generate_problem(s)["question"] for s in range(400)]
    assert len(set(qs)) >= 395
    openings = {q.split()[0] for q in qs}
    assert len(openings) > 40  # many names and sentence forms, not one template


def test_train_and_heldout_are_disjoint(tmp_path):
    train = load_math_corpus("train", n=3000, cache_dir=tmp_path)
    held = load_math_corpus("heldout", n=300, cache_dir=tmp_path)
    assert set(train["seed"]).isdisjoint(held["seed"])
    assert min(held["seed"]) >= MATH_HELDOUT_SEEDS.start and max(train["seed"]) < MATH_TRAIN_SEEDS.stop
    assert set(train["question"]).isdisjoint(set(held["question"]))
    # disjointness holds by construction: each split only ever emits questions of its own hash bucket
    assert all(math_gen._is_heldout_text(q) for q in held["question"])
    assert not any(math_gen._is_heldout_text(q) for q in list(train["question"])[:500])


def test_math_corpus_columns(tmp_path):
    ds = load_math_corpus("heldout", n=5, cache_dir=tmp_path)
    assert set(ds.column_names) >= {"id", "question", "solution", "answer", "prompt", "text"}
    row = ds[0]
    assert row["text"] == row["prompt"] + " " + row["solution"]
    assert row == {**row, **{k: v for k, v in generate_problem(row["seed"]).items()}}


def test_code_corpus_split_and_exclusions(tmp_path):
    train = load_code_corpus("train", cache_dir=tmp_path)
    held = load_code_corpus("heldout", cache_dir=tmp_path)
    assert set(train["id"]).isdisjoint(held["id"])
    assert len(held) > 0 and 0.02 < len(held) / (len(train) + len(held)) < 0.10
    ids = list(train["id"]) + list(held["id"])
    for rel in ids:
        parts = rel.split("/")
        assert rel.endswith(".py")
        assert not any(p in {"idlelib", "turtledemo", "site-packages"} or p.startswith("test") for p in parts[:-1]), rel
    # deduplicated by content across both splits
    texts = list(train["text"]) + list(held["text"])
    assert len(set(texts)) == len(texts)
    # deterministic order
    assert list(train["id"]) == sorted(train["id"])
    assert "os.py" in ids


def test_code_file_listing_skips_excluded_folders():
    files = [p.as_posix() for p in list_code_files()]
    assert files == sorted(files)
    assert not any(f.startswith(("test/", "idlelib/", "turtledemo/")) or "/test/" in f or "/tests/" in f
                   for f in files)


def test_cache_is_reused_and_rebuilt_on_version_change(tmp_path, monkeypatch):
    first = load_math_corpus("heldout", n=10, cache_dir=tmp_path)

    def boom(*a, **k):
        raise AssertionError("rebuilt although nothing changed")

    monkeypatch.setattr(corpora, "_build_math", boom)
    again = load_math_corpus("heldout", n=10, cache_dir=tmp_path)
    assert list(again["question"]) == list(first["question"])

    # a new generator version is a new fingerprint: the cached copy must not be used
    monkeypatch.setattr(math_gen, "GENERATOR_VERSION", "test-bump")
    with pytest.raises(AssertionError, match="rebuilt"):
        load_math_corpus("heldout", n=10, cache_dir=tmp_path)
    monkeypatch.undo()
    built = [d for d in os.listdir(tmp_path) if d.startswith("math-heldout-")]
    assert len(built) == 1


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("DOMINO_LAB_CACHE", str(tmp_path / "envcache"))
    load_math_corpus("heldout", n=3)
    assert any(d.startswith("math-heldout-") for d in os.listdir(tmp_path / "envcache"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere; covered by the not-a-folder case")
def test_unwritable_cache_dir_readonly(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    with pytest.raises(UserError, match="not writable"):
        load_math_corpus("heldout", n=3, cache_dir=ro)


def test_unwritable_cache_dir_gives_one_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(UserError) as e:
        load_math_corpus("heldout", n=3, cache_dir=blocker / "cache")
    msg = str(e.value)
    assert "\n" not in msg and "not writable" in msg and "DOMINO_LAB_CACHE" in msg


def test_bad_split_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="split"):
        load_code_corpus("validation", cache_dir=tmp_path)


def test_text_shorter_than_one_window_is_one_error_naming_the_knob():
    """A recipe whose seq_len outgrows its data (a tiny corpus, a long window) gets the key to change, not a bare
    ValueError from the packing code."""
    import numpy as np

    from domino_lab.data.packing import FixedWindows, MixedWindows

    for n in (5, 8):             # exactly one window's tokens is still too few for random windows
        with pytest.raises(UserError, match=f"code training text has {n} tokens, and random windows of data.seq_len "
                                            "8 need more"):
            MixedWindows({"code": np.zeros(n, np.int32), "math": np.zeros(50, np.int32)}, 8, 0.5, 0)
    with pytest.raises(UserError, match="held-out text has 3 tokens.*lower data.seq_len"):
        FixedWindows(np.zeros(3, np.int32), 8, 2)
