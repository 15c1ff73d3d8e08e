"""The paired statistics every drafter comparison rests on (evaluate.paired_pooled, experiments.report.pooled_pair),
checked on inputs whose answers are worked out by hand."""
import math

import pytest

from domino_lab.evaluate import paired, paired_pooled, t_interval
from domino_lab.experiments.report import pooled_pair


def _res(taus: dict, steps: dict | None = None) -> dict:
    rows = [{"id": k, "tau": v, "steps": (steps or {}).get(k, 4)} for k, v in taus.items()]
    return {"per_prompt": rows, "tau": sum(taus.values()) / len(taus)}


def test_the_interval_is_students_t_not_the_normal_one():
    m, lo, hi = t_interval([1.0, 3.0])
    # mean 2, sd sqrt(2), n 2: half-width t(0.975, 1) * sqrt(2) / sqrt(2) = 12.706
    assert m == 2.0 and hi - m == pytest.approx(12.7062, abs=1e-3) and m - lo == pytest.approx(12.7062, abs=1e-3)
    assert all(math.isnan(x) for x in t_interval([5.0])[1:])


def test_prompts_are_the_units_of_a_pooled_interval():
    """Three seeds of two prompts: six differences, but the interval is over the two prompts' means (a prompt's
    differences across seeds move together), not over six independent rows."""
    a = [_res({"p": 3.0 + s, "q": 1.0}) for s in range(3)]
    b = [_res({"p": 2.0 + s, "q": 0.5}) for s in range(3)]
    pr = paired_pooled(list(zip(a, b)))
    assert pr["n"] == 6 and pr["prompts"] == 2 and pr["wins"] == 6
    assert pr["mean_diff"] == pytest.approx(0.75)
    m, lo, hi = t_interval([1.0, 0.5])
    assert pr["ci95"] == pytest.approx([lo, hi])


def test_a_prompt_with_no_steps_on_either_side_is_left_out_both_ways():
    a, b = _res({"p": 0.0, "q": 3.0}, steps={"p": 0}), _res({"p": 2.0, "q": 2.0})
    assert paired(a, b)["n"] == paired(b, a)["n"] == 1
    assert paired(a, b)["mean_diff"] == -paired(b, a)["mean_diff"] == 1.0
    assert paired(_res({"p": 1.0}, {"p": 0}), _res({"p": 1.0}))["n"] == 0     # nothing left: n 0, NaN interval


def test_a_one_seed_variant_pairs_with_every_seed_of_the_other():
    """`ar` and shipped checkpoints carry the seed label "0", which a three-seed variant has too: matching labels
    paired the single seed with seed 0 only and dropped seeds 1 and 2."""
    multi = {str(s): _res({"x": 3.0 + 2 * s, "y": 3.0 + 2 * s}) for s in range(3)}
    single = {"0": _res({"x": 2.0, "y": 2.0})}
    pr = pooled_pair({"m": multi, "s": single}, "m", "s")
    assert pr["n_seed_pairs"] == 3 and pr["n"] == 6 and pr["mean_diff"] == pytest.approx(3.0)
    # two multi-seed variants still pair seed by seed
    other = {str(s): _res({"x": 1.0 + 2 * s, "y": 1.0 + 2 * s}) for s in range(3)}
    pr = pooled_pair({"m": multi, "o": other}, "m", "o")
    assert pr["n_seed_pairs"] == 3 and pr["mean_diff"] == pytest.approx(2.0) and pr["ratios"][0] == 3.0


def test_the_same_run_decoded_two_ways_pairs_seed_by_seed():
    """A variant of the same trained drafters restricted to seed 0 (say with an FR-Spec list) compares with seed 0
    of the full variant only: the other seeds are other drafters, not the same one decoded another way."""
    full = {str(s): _res({"x": 3.0 + s, "y": 3.0 + s}) for s in range(3)}
    restricted = {"0": _res({"x": 2.5, "y": 2.5})}
    pr = pooled_pair({"r": restricted, "f": full}, "r", "f", same_run=True)
    assert pr["n_seed_pairs"] == 1 and pr["n"] == 2 and pr["mean_diff"] == pytest.approx(-0.5)


def test_per_position_acceptance_counts_the_drafts_the_target_judged():
    """P(accepted | reached): the accepted drafts and the first rejected one are reached; after an accepted EOS (the
    step's bonus None) the text ended, so the drafts after it were never judged and count for nothing."""
    from domino_lab.decoding.metrics import StepTally
    from domino_lab.decoding.records import StepRecord

    def step(drafts, accepted, bonus):
        return StepRecord(start=0, anchor=5, draft_tokens=drafts, accepted=accepted, bonus=bonus,
                          committed=drafts[:accepted] + ([bonus] if bonus is not None else []))

    t = StepTally().add([step([7, 8, 9, 10], 1, 4),          # d1 accepted, d2 rejected
                         step([7, 0, 9, 10], 2, None)])       # d1 accepted, d2 = EOS (0) accepted: the text ended
    assert t.accept_pos == [1.0, 0.5, None, None]
    assert t.tau == pytest.approx((2 + 2) / 2)


def test_the_tree_experiments_table_counts_prompts_and_differences_apart():
    """experiments/tree.py with three seeds per drafter family: the table says how many prompts its interval is over
    and, apart from them, how many differences its wins / losses / ties count."""
    from core_helpers import experiment_script

    tree = experiment_script("tree")

    def row(label, taus):
        return {"label": label, "nodes": 0, "tau": 1.0, "per_prompt": [{"id": k, "tau": v} for k, v in taus.items()]}

    rows = {}
    for s in range(3):
        rows[f"a/{s}@0"] = row(f"a/{s}", {"p": 3.0 + s, "q": 1.0})
        rows[f"b/{s}@0"] = row(f"b/{s}", {"p": 2.0 + s, "q": 0.5})
    table = tree.compare_table(tree.compare({"math": rows}, "a", "b"), "a", "b")
    m, lo, hi = t_interval([1.0, 0.5])
    assert f"| math | chain | 2 | 6 | +0.75 | [{lo:+.2f}, {hi:+.2f}] | 6 / 0 / 0 |" in table
    assert "| set | N | prompts | differences |" in table
