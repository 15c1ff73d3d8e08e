"""The adaptive draft count of batched decoding (decoding/adaptive.py): its estimates and its choice."""
import pytest

from domino_lab.decoding.adaptive import DraftCount, PlainFallback


def _explore(policy: DraftCount, rows: int, accepted: int, t_draft: float, verify) -> None:
    """Drive the policy through its exploration steps with a synthetic cost line `verify(positions)`."""
    n = policy.choose(rows, 8)
    assert n == 8                                          # the whole block first (its draft takes in the prompt)
    policy.update(n, rows, verify(rows * 9), [accepted] * rows, 3 * t_draft, taken=20)
    n = policy.choose(rows, 8)
    assert n == 1 and policy.t_draft is None               # then one draft: a steady draft's time, a second point
    policy.update(n, rows, verify(rows * 2), [min(accepted, 1)] * rows, t_draft, taken=9)
    assert policy.t_take == pytest.approx(2 * t_draft / (rows * 20))     # the prompt's catch-up, per position
    for hiccup in (2.0, 0.8):
        n = policy.choose(rows, 8, 2)
        assert n == 0                                      # then two plain steps, timed on their own
        policy.update(n, rows, hiccup * verify(rows))      # (cheaper than the line: no block mask)
    assert policy.plain_cost(rows) == pytest.approx(0.8 * verify(rows))    # the cheaper of the two


def _full_steps(policy, k: int, rows: int, accepted: int, t_draft: float, t_verify: float) -> None:
    for _ in range(k):
        policy.update(8, rows, t_verify, [accepted] * rows, t_draft, taken=9)


def test_acceptance_estimates_are_conditional_on_reaching_the_draft():
    p = DraftCount(4, fast=1.0, slow=1.0)
    p.update(4, 3, 1.0, [0, 2, 4], 0.0)       # draft 0 reached by 3 rows, accepted by 2; draft 2 reached by 2
    for reached, acc in p.counts.values():
        assert reached == [3, 2, 2, 1] and acc == [2, 2, 1, 1]
    slow0 = 3 / 5
    assert p.alpha(0) == pytest.approx((2 + 2 * slow0) / (3 + 2))
    a = [p.alpha(i) for i in range(4)]
    assert p.expected_committed(0) == 1.0
    assert p.expected_committed(2) == pytest.approx(1 + a[0] + a[0] * a[1])
    assert p.expected_committed(4) > p.expected_committed(3) > p.expected_committed(2)


def test_cheap_positions_and_good_drafts_verify_the_whole_block():
    """Batch-1 regime: a verified position costs little next to the step (weights streamed once)."""
    p = DraftCount(8)
    line = lambda x: 6e-3 + 0.4e-3 * x                    # noqa: E731
    _explore(p, rows=1, accepted=8, t_draft=3e-3, verify=line)
    assert p.verify_cost(9) == pytest.approx(line(9))
    _full_steps(p, 20, 1, 8, 3e-3, line(9))
    assert p.choose(1, 8) == 8
    assert p.choose(1, 3) == 3                             # never past the budget left


def test_costly_positions_and_poor_drafts_fall_back_to_plain_steps():
    """Batch-16 regime: every verified position is compute; drafts that are rarely accepted do not pay."""
    p = DraftCount(8)
    _explore(p, rows=16, accepted=0, t_draft=15e-3, verify=lambda x: 10e-3 + 1e-3 * x)
    assert p.choose(16, 8) == 0
    # the same drafts on a cheap machine pay again: the choice follows the measured line, not the batch size
    q = DraftCount(8)
    _explore(q, rows=16, accepted=8, t_draft=1e-3, verify=lambda x: 10e-3 + 1e-5 * x)
    assert q.choose(16, 8) == 8


def test_a_bad_stretch_is_forgotten_while_plain_steps_run():
    """A few drafting steps that miss make plain steps win; while they run the fast estimate returns to the
    batch's long-run acceptance, and drafting is tried again."""
    p = DraftCount(8)
    line = lambda x: 6e-3 + 0.4e-3 * x                    # noqa: E731
    _explore(p, rows=1, accepted=8, t_draft=3e-3, verify=line)
    _full_steps(p, 40, 1, 7, 3e-3, line(9))               # a good text ...
    assert p.choose(1, 8, pending=9) > 0
    _full_steps(p, 25, 1, 0, 3e-3, line(9))               # ... then a hard stretch
    assert p.choose(1, 8, pending=9) == 0
    k = 0
    while p.choose(1, 100, pending=1 + k) == 0:
        p.update(0, 1, 0.8 * line(1))
        k += 1
    assert 0 < k < 30


def test_costs_are_refitted_as_the_line_moves():
    p = DraftCount(8, fast=0.5)
    line = lambda x: 5e-3 + 0.1e-3 * x                    # noqa: E731
    _explore(p, rows=4, accepted=8, t_draft=2e-3, verify=line)
    _full_steps(p, 10, 4, 8, 2e-3, line(36))
    assert p.choose(4, 8) == 8
    for _ in range(20):                                    # the machine gets slower per position
        p.update(8, 4, 5e-3 + 10e-3 * 36, [8] * 4, 2e-3, taken=9)
        p.update(1, 4, 5e-3 + 10e-3 * 8, [1] * 4, 2e-3, taken=9)
    assert p.verify_cost(36) == pytest.approx(5e-3 + 10e-3 * 36, rel=1e-3)
    assert p.choose(4, 8) < 8


def test_a_switch_back_to_drafting_pays_for_its_catch_up():
    """After plain steps a draft must first take in their positions; the choice charges that (measured on the
    prompt's catch-up draft, spread over the steps left), so a draft that barely pays when steady is not chosen
    after a long run of plain steps near the end of the budget."""
    p = DraftCount(8)
    _explore(p, rows=4, accepted=8, t_draft=4e-3, verify=lambda x: 6e-3 + 0.3e-3 * x)
    _full_steps(p, 10, 4, 8, 4e-3, 6e-3 + 0.3e-3 * 36)
    assert p.choose(4, 8, pending=9) == 8
    assert p.choose(4, 8, pending=400) == 0


def test_the_policy_is_checked_and_parsed():
    from core_helpers import tiny_target
    from domino_lab.bench import build_parser
    from domino_lab.models.options import with_options
    from domino_lab.decoding.batched import batched_generate
    from domino_lab.errors import UserError
    from domino_lab.models import InferenceOptions

    with pytest.raises(UserError, match="unknown batch drafts policy 'some'"):
        InferenceOptions(batch_drafts="some")
    with pytest.raises(UserError, match="unknown batch drafts policy 'bogus'"):
        batched_generate(tiny_target(), None, [[5, 6]], 4, drafts="bogus")
    args = build_parser().parse_args(["--batch-drafts", "all"])
    assert InferenceOptions.from_args(args).batch_drafts == "all"
    assert InferenceOptions.from_args(build_parser().parse_args([])).batch_drafts == "adaptive"
    assert with_options(InferenceOptions(), "batch_drafts=all", "x").batch_drafts == "all"


def test_plain_steps_wait_for_evidence():
    """At batch 1 the first steps are few rows of evidence: the whole block is drafted until eight rows have
    tried the first draft, even when those first steps missed."""
    p = DraftCount(8)
    line = lambda x: 6e-3 + 0.4e-3 * x                    # noqa: E731
    _explore(p, rows=1, accepted=0, t_draft=3e-3, verify=line)
    tried = 2
    while p.choose(1, 8, pending=1) == 8:
        p.update(8, 1, line(9), [0], 3e-3, taken=1)
        tried += 1
    assert 8 <= tried <= 9 and p.choose(1, 8, pending=1) == 0     # (the counts age by 1% a step)


class _FixedCosts(PlainFallback):
    """The engine's policy with its measured times replaced by fixed ones (draft 3 ms, verify 8 ms, plain step
    5 ms): what it chooses then depends on the committed counts alone, not on how loaded the machine is."""

    def update(self, n, committed, t_draft, t_verify, drafted=None, steady=True):
        plain = n == 0 and not drafted
        super().update(n, committed, 0.0 if plain else 3e-3, 5e-3 if plain else 8e-3, drafted, steady)


def test_batch_1_adaptive_drafts_are_lossless_and_fall_back_to_plain_steps(target, monkeypatch):
    """A drafter that is never right (untrained) drafts its warm-up steps, then plain steps take over, with a
    probe every few of them; the output is the target's greedy output."""
    from domino_lab import Drafter, speculative_generate
    from domino_lab.decoding import engine
    from domino_lab.models import InferenceOptions

    d = Drafter.untrained(target, "domino", seed=0, block_size=8).set_options(InferenceOptions(adaptive_drafts=True))
    always = Drafter.untrained(target, "domino", seed=0, block_size=8)
    for fixed in (False, True):
        if fixed:
            monkeypatch.setattr(engine, "PlainFallback", _FixedCosts)
        for p in ([5, 9, 17], [40, 41, 42, 43], [11, 30, 7, 7, 12]):
            plain = speculative_generate(target, None, prompt_ids=p, max_new_tokens=48)
            res = speculative_generate(target, d, prompt_ids=p, max_new_tokens=48)
            assert res.token_ids == plain.token_ids
            assert res.token_ids == speculative_generate(target, always, prompt_ids=p, max_new_tokens=48).token_ids
            counts = [len(s.draft_tokens) for s in res.steps]
            assert counts[:PlainFallback.WARMUP] == [8] * PlainFallback.WARMUP, counts
            if fixed and len(counts) > 24:     # (measured times on a loaded machine may let a probe win)
                assert counts[:-1].count(0) > len(counts) // 2, counts     # mostly plain after the warm-up
                assert counts[PlainFallback.WARMUP + 1:-1].count(8) >= 1, counts     # and probes between them


def test_plain_fallback_keeps_drafting_where_it_pays_and_probes_with_backoff():
    p = PlainFallback(8)
    for _ in range(4):                          # a drafter committing 5 tokens a step: never worth a plain step
        assert p.choose(8) == 8
        p.update(8, 5, 3e-3, 8e-3)
    assert p.choose(8) == 8 and p.t_plain is None and p.choose(3) == 3
    q = PlainFallback(8)
    for _ in range(4):                          # 1.2 tokens a step at 11 ms: a plain step (5 ms) is timed
        q.update(8, 1, 3e-3, 8e-3)
    assert q.choose(8) == 0
    q.update(0, 1, 0.0, 5e-3)
    chosen = []
    for _ in range(40):
        n = q.choose(8)
        chosen.append(n)
        q.update(n, 1, 3e-3 if n else 0.0, 8e-3 if n else 5e-3, steady=False)
    probes = [i for i, n in enumerate(chosen) if n]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert probes and gaps == sorted(gaps) and max(gaps) > 4, chosen     # losing probes wait longer each time


def test_batch_1_adaptive_drafts_are_checked_and_parsed(target):
    from domino_lab import Drafter, speculative_generate
    from domino_lab.bench import build_parser
    from domino_lab.models.options import with_options
    from domino_lab.errors import UserError
    from domino_lab.models import InferenceOptions

    d = Drafter.untrained(target, "domino", seed=0, block_size=4).set_options(InferenceOptions(adaptive_drafts=True))
    with pytest.raises(UserError, match="adaptive drafts choose a chain's length"):
        speculative_generate(target, d, prompt_ids=[5, 6], max_new_tokens=4, tree_nodes=8)
    assert InferenceOptions.from_args(build_parser().parse_args(["--adaptive-drafts"])).adaptive_drafts is True
    assert InferenceOptions.from_args(build_parser().parse_args([])).adaptive_drafts is False
    assert with_options(InferenceOptions(), "adaptive_drafts=true", "x").adaptive_drafts is True


def test_one_row_at_a_time_verifies_the_whole_block_every_step(monkeypatch):
    """The count learns acceptance only while drafting: at one row a text whose first drafts miss would stay on
    plain steps (one-position verifies) for the rest of the decode. One prompt, or a queue through one slot,
    drafts the whole block every step instead, as batch-1 decoding does; a batch of two still explores."""
    from core_helpers import tiny_target
    from domino_lab import Drafter, speculative_generate
    from domino_lab.decoding.batched import batched_generate

    t = tiny_target(eos=None)
    d = Drafter.untrained(t, "domino", seed=0, block_size=4)
    widths = []
    forward = t.forward

    def recording(ids, **kw):
        widths.append(ids.shape[1])
        return forward(ids, **kw)

    monkeypatch.setattr(t, "forward", recording)
    prompts = [[5, 9, 17], [40, 41, 42, 43], [11, 30, 7, 7, 12]]
    for batch, slots in (([prompts[0]], None), (prompts, 1), (prompts[:2], None)):
        widths.clear()
        res = batched_generate(t, d, batch, 40, slots=slots, drafts="adaptive")
        plain = widths.count(1)            # a plain step (the last token of a budget verifies no draft either)
        if slots == 1 or len(batch) == 1:
            assert plain <= len(batch) and max(widths) == d.config.num_drafts + 1, widths
        else:
            assert plain >= 2, widths      # the count's exploring plain steps
        for p, out in zip(batch, res.token_ids):
            assert out == speculative_generate(t, None, prompt_ids=p, max_new_tokens=40).token_ids
