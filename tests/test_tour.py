"""`python -m domino_lab.tour`: one prompt decoded step by step, each Domino step beside its backbone alone."""
import re

import pytest

from domino_lab import Target, speculative_generate
from domino_lab.decoding.same_text import pair_steps
from domino_lab.models import load_drafter
from domino_lab.tour import main
from core_helpers import run_main


def run(argv, capsys):
    return run_main(main, argv, capsys)


def test_the_tour_shows_a_lossless_decode_and_its_best_step(tmp_path, capsys):
    out_file = tmp_path / "tour.md"
    code, out, err = run(["--max-new-tokens", "40", "--out", str(out_file)], capsys)
    assert code == 0, err
    assert out_file.read_text() + "\n" == out
    for heading in ("## 1. The target alone", "## 2. One step", "## 3. What the head did", "## 4. The whole decode"):
        assert heading in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and line.count("|") == 6
            and not line.startswith("| decoding") and "---" not in line]
    names = [r.split("|")[1].strip() for r in rows]
    assert names == ["plain", "Domino (default)", "its backbone alone (default, head off)",
                     "baseline (default-dflash)"]
    assert [r.split("|")[5].strip() for r in rows[1:]] == ["yes"] * 3
    # the highlighted step: the verdict columns agree with the counts stated under the table
    on, off = (int(x) for x in re.search(r"With the head: (\d+) drafts accepted .* from the same text: (\d+) \+",
                                         out).groups())
    table = out.split("| slot | backbone alone |")[1].split("\n\n")[0]
    slots = [line.split("|") for line in table.splitlines() if re.match(r"\| \d+ \|", line)]
    assert sum(c[4].strip() == "accepted" for c in slots) == off
    assert sum(c[7].strip() == "accepted" for c in slots) == on
    # the per-step tokens add up to the decode's output (the prefill's token comes first)
    steps = re.findall(r"^\| (\d+) \| `.*` \| (\d+)(?: \([+−]\))? \| (\d+) \|$", out, re.M)
    forwards = int(rows[1].split("|")[2])
    assert [int(s[0]) for s in steps] == list(range(1, forwards))
    assert sum(int(s[1]) for s in steps) + 1 == 40        # (this prompt's greedy text runs past 40 tokens)
    on_total, off_total = (int(x) for x in re.search(r"committed (\d+) tokens, without it (\d+)", out).groups())
    assert on_total == sum(int(s[1]) for s in steps) and off_total == sum(int(s[2]) for s in steps)


def test_each_head_off_step_drafts_the_backbones_own_argmax():
    """The head-off step is a real decode from the same text: its drafts are the base logits' argmax that the
    head-on step recorded before its correction, slot for slot."""
    target = Target.from_pretrained("default", dtype="float32")
    drafter = load_drafter("default", target)
    for prompt in ("Question: A farmer has 3 pens with 7 sheep each. How many sheep?\nAnswer:",
                   "def count_words(text):\n    "):
        ids = target.encode(prompt)
        res = speculative_generate(target, drafter, prompt_ids=ids, max_new_tokens=30, topk=5)
        pairs = pair_steps(target, drafter, ids, res, 30, 5)
        assert len(pairs) == len(res.steps) and drafter.head_enabled      # (redrafted by a head-off copy)
        for p in pairs:
            assert p.off.draft_tokens == [b[0] for b in p.on.base_topk_ids]
            assert p.gain == p.on.acceptance_length - p.off.acceptance_length
        assert sum(p.on.acceptance_length for p in pairs) + 1 == len(res.token_ids)


@pytest.mark.parametrize("argv, message", [
    (["--index", "1000"], "--index 1000 is past the end of 'math'"),
    (["--index", "-1"], "--index must be >= 0"),
    (["--drafter", "default-dflash"], "has no Domino head"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--prompt", "  "], "the prompt is empty"),
])
def test_bad_input_is_one_error_line_and_writes_nothing(argv, message, tmp_path, capsys):
    out_file = tmp_path / "tour.md"
    code, out, err = run(argv + ["--out", str(out_file)], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert not out_file.exists()


def test_out_into_a_folder_is_refused(tmp_path, capsys):
    code, out, err = run(["--out", str(tmp_path)], capsys)
    assert code == 2 and err.startswith("error: --out") and err.count("\n") == 1, err


def test_pair_steps_refuses_what_it_cannot_pair():
    target = Target.from_pretrained("default", dtype="float32")
    dflash = load_drafter("default-dflash", target)
    res = speculative_generate(target, dflash, prompt="def f(x):", max_new_tokens=8)
    with pytest.raises(ValueError, match="has no head"):
        pair_steps(target, dflash, target.encode("def f(x):"), res, 8)
    domino = load_drafter("default", target)
    tree = speculative_generate(target, domino, prompt="def f(x):", max_new_tokens=8, tree_nodes=8)
    with pytest.raises(ValueError, match="verified trees"):
        pair_steps(target, domino, target.encode("def f(x):"), tree, 8)
    from domino_lab.models import InferenceOptions

    copying = load_drafter("default", target, options=InferenceOptions(lookup=3))
    res = speculative_generate(target, copying, prompt="def f(x):", max_new_tokens=8)
    with pytest.raises(ValueError, match="lookup drafting and adaptive drafts off"):
        pair_steps(target, copying, target.encode("def f(x):"), res, 8)


def test_the_tour_runs_on_a_hugging_face_target_directory(tmp_path, capsys):
    """Any local HF causal LM with a fresh drafter: the tour needs no shipped asset, and its texts stay lossless."""
    from core_helpers import make_target_dir

    tdir = make_target_dir(tmp_path / "target")
    code, out, err = run(["--target", str(tdir), "--drafter", "untrained:domino:block_size=4", "--baseline",
                          "untrained:dflash:block_size=4", "--prompt", "def add(a, b):", "--max-new-tokens", "12"],
                         capsys)
    assert code == 0, err
    rows = [line for line in out.splitlines() if line.startswith("| ") and line.count("|") == 6
            and not line.startswith("| decoding") and "---" not in line]
    assert len(rows) == 4 and [r.split("|")[5].strip() for r in rows[1:]] == ["yes"] * 3
    assert "| slot | backbone alone |" in out and "| 4 |" in out.split("| slot | backbone alone |")[1]
