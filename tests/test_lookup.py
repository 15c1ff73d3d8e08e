"""Lookup drafting: copying the continuation of the text's own earlier n-grams. The index finds the latest, longest
match and extends loops past the end; greedy decoding with it stays lossless on the shipped drafters and really
copies; sampling stays exact (a copy is a draft from a point mass); misuse is one clear error."""

import pytest

from domino_lab import Drafter, Target, speculative_generate
from domino_lab.data.eval_sets import load_eval_set
from domino_lab.decoding.lookup import MAX_NGRAM, NgramLookup, draft_lookup
from domino_lab.errors import UserError
from domino_lab.models import load_drafter
from domino_lab.models.options import InferenceOptions
from core_helpers import tiny_target
from test_sampling import exact_distribution, sample_many, tv


def test_lookup_copies_the_latest_continuation_of_the_longest_suffix():
    lk = NgramLookup(2, [5, 6, 7, 1, 5, 6, 8, 2, 9, 5, 6])
    # suffix (5, 6) occurred twice before; the latest occurrence was followed by 8, 2, 9, ...
    assert lk.propose(3) == ([8, 2, 9], 2)
    lk.extend([7])
    # now (5, 6, 7) matches at the start, a longer match than (6, 7) alone: copy what followed it there
    assert lk.propose(2) == ([1, 5], 3)


def test_lookup_repeats_a_loop_past_the_end_and_needs_min_ngram():
    lk = NgramLookup(2, [3, 4, 1, 2, 1, 2])
    toks, n = lk.propose(5)
    assert toks == [1, 2, 1, 2, 1] and n == 2          # period 2, continued beyond the text
    assert NgramLookup(3, [7, 1, 2, 8, 1, 2]).propose(4) == ([], 0)     # only a 2-token match: below min_ngram
    assert NgramLookup(1, [9]).propose(3) == ([], 0)                     # nothing earlier to copy from


def test_lookup_index_matches_a_brute_force_search():
    import random

    rng = random.Random(0)
    seq = [rng.randrange(4) for _ in range(200)]
    lk = NgramLookup(2)
    for i, t in enumerate(seq):
        lk.extend([t])
        got, n = lk.propose(3)
        want_n = 0
        for m in range(min(MAX_NGRAM, i), 1, -1):      # longest suffix of seq[:i+1] seen earlier
            suf = seq[i + 1 - m: i + 1]
            starts = [s for s in range(0, i + 1 - m) if seq[s: s + m] == suf]
            if starts:
                want_n, s = m, starts[-1] + m
                ext = seq[: i + 1]
                for k in range(3):
                    ext.append(ext[s + k])
                assert got == ext[i + 1:], (i, m)
                break
        assert n == want_n, i


def test_offer_copies_only_where_the_texts_copies_have_started_right():
    # "1 2" recurs four times, each time followed by something new: every copy there would have started wrong
    misses = draft_lookup(2, [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2, 6, 1, 2, 7, 1, 2])
    assert misses.propose(8)[0][:1] == [7]
    assert misses.offer(8) == misses.propose(8)[0]      # no drafting step yet: nothing to compare the copy with
    misses.update([], accepted=5, proposed=8, copied=False)   # the drafter's steps commit 6 tokens here
    assert misses.offer(8) == []                        # expected copy: 1 token (h = 0)
    # a loop: every copy would have started right (h = 1), so a copy of 8 is expected to commit 9 > 6
    loop = draft_lookup(2, [1, 2, 3] * 5 + [1, 2])
    loop.update([], accepted=5, proposed=8, copied=False)
    assert loop.offer(8) == loop.propose(8)[0] == [3, 1, 2, 3, 1, 2, 3, 1]
    assert loop.offer(3) == []                          # ... but a copy of 3 commits at most 4 < 6
    # the fixed index a copy-input drafter reads offers every match (it keeps no drafter record)
    assert NgramLookup(2, [1, 2, 3, 1, 2, 4, 1, 2], adaptive=False).offer(2) == [4, 1]


@pytest.fixture(scope="module")
def embedded():
    t = Target.from_pretrained("default", dtype="float32")
    prompts = [load_eval_set(s, limit=4)[i]["prompt"] for s in ("math", "humaneval", "unseen") for i in (0, 3)]
    return t, prompts


@pytest.mark.parametrize("spec", ["default", "default-dflash", "default-eagle"])
def test_greedy_with_lookup_is_lossless_and_copies(embedded, spec):
    t, prompts = embedded
    d = load_drafter(spec, t, options=InferenceOptions(lookup=2))
    copied = drafted = 0
    for prompt in prompts:
        plain = speculative_generate(t, None, prompt=prompt, max_new_tokens=64).token_ids
        res = speculative_generate(t, d, prompt=prompt, max_new_tokens=64)
        assert res.token_ids == plain, prompt
        copied += sum(s.copied for s in res.steps)
        drafted += sum(not s.copied for s in res.steps)
    assert copied > 0 and drafted > 0, (copied, drafted)


def test_lookup_with_tree_verification_is_lossless(embedded):
    t, prompts = embedded
    for spec in ("default", "default-dflash"):
        d = load_drafter(spec, t, options=InferenceOptions(lookup=3))
        kinds = set()
        for prompt in prompts:
            plain = speculative_generate(t, None, prompt=prompt, max_new_tokens=48).token_ids
            res = speculative_generate(t, d, prompt=prompt, max_new_tokens=48, tree_nodes=16)
            assert res.token_ids == plain, (spec, prompt)
            kinds |= {(s.copied, s.tree_tokens is not None) for s in res.steps[:-1]}
        assert kinds == {(True, False), (False, True)}, kinds    # copies verified as chains, other steps as trees


def test_lookup_needs_a_drafter(embedded):
    from domino_lab.decoding.engine import check_lookup_mode

    with pytest.raises(UserError, match="give a drafter"):
        check_lookup_mode(None, 3)
    check_lookup_mode(None, 0)


def test_sampling_with_lookup_matches_the_target_distribution():
    t = tiny_target(vocab=5, layers=3, hidden=16, eos=None, logit_scale=60.0)
    t.eos_token_ids = set()
    prompt = [1, 2, 0, 1, 2]
    exact = exact_distribution(t, prompt, 3, 1.0)
    d = Drafter.untrained(t, "domino", seed=0, block_size=4).set_options(InferenceOptions(lookup=1))
    kinds = {s.copied for seed in range(20) for s in speculative_generate(
        t, d, prompt_ids=prompt, max_new_tokens=8, temperature=1.0, seed=seed).steps}
    assert kinds == {True, False}           # both copied and drafted steps occur at T = 1
    n = 1000
    assert tv(sample_many(t, d, prompt, n), exact, n) < 0.08


def test_batched_decoding_with_lookup_is_lossless_and_copies(embedded):
    from domino_lab.decoding.batched import batched_generate

    t, prompts = embedded
    ids = [t.encode(p) for p in prompts]
    plain = batched_generate(t, None, ids, 48)
    # the whole block every step, so τ measures the drafts (the adaptive count would mix in plain steps)
    # a drafter without the copy input, which cannot copy by itself
    alone = batched_generate(t, load_drafter("default-nocopy", t), ids, 48, drafts="all")
    res = batched_generate(t, load_drafter("default-nocopy", t, options=InferenceOptions(lookup=3)), ids, 48,
                           drafts="all")
    assert res.token_ids == plain.token_ids == alone.token_ids
    # the looping HumanEval prompt (index 3) commits more per step once its row copies
    tau = [sum(a) / len(a) for a in (alone.acceptance_lengths[3], res.acceptance_lengths[3])]
    assert tau[1] > tau[0] + 0.5, tau


def test_copy_gap_classifies_steps_by_what_a_copy_would_have_drafted(tmp_path):
    """experiments/copy_gap.py: a step where the text quotes itself is `copy right` with the copy's accepted length,
    one whose suffix is new is `no copy`; the script runs end to end and checks every decode against plain."""
    import json
    import sys
    from pathlib import Path

    from domino_lab.decoding import StepRecord

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))
    import copy_gap

    text = [5, 6, 7, 8, 5, 6, 7, 8, 5, 9]
    loop = StepRecord(start=6, anchor=7, draft_tokens=[9, 9, 9], accepted=0, bonus=8, committed=[8],
                      draft_time_s=0.0, verify_time_s=0.0)
    fresh = StepRecord(start=2, anchor=7, draft_tokens=[8, 1], accepted=1, bonus=5, committed=[8, 5],
                       draft_time_s=0.0, verify_time_s=0.0)
    rows = copy_gap.classify([loop, fresh], text, 3)
    assert rows == [{"class": "copy right", "accepted": 0, "copy": 2}, {"class": "no copy", "accepted": 1, "copy": 0}]
    t = copy_gap.tally(rows)
    assert t["copy right"]["share"] == 0.5 and t["copy wrong"]["steps"] == 0 and t["no copy"]["first_accepted"] == 1.0
    with pytest.raises(UserError, match="--min-ngram"):
        copy_gap.parse_args(["--min-ngram", "0"])
    assert copy_gap.main(["--quick", "--limit", "1", "--sets", "math", "--drafter", "dflash=default-dflash",
                          "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "copy_gap.json").read_text())
    r = data["results"]["math"]["dflash"]
    assert r["lossless"] == r["prompts"] == 1 and abs(sum(c["share"] for c in r["classes"].values()) - 1) < 1e-9
    assert "| math | dflash |" in (tmp_path / "copy_gap.md").read_text()
