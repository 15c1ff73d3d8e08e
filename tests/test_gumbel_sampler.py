"""The Gumbel-coupled sampler: exact in distribution, and the sampled text a function of the seed alone, the same
for plain decoding and every drafter, chain or tree, lookup, cutoff and adaptive drafts."""
from collections import Counter

import pytest
import torch

from domino_lab import Drafter, sampling, speculative_generate
from domino_lab.errors import UserError
from domino_lab.models.options import InferenceOptions
from core_helpers import tiny_target
from test_sampling import N, exact_distribution, tv


def test_noise_is_a_function_of_seed_and_position():
    a, b = sampling.GumbelNoise(7, 50, 1.0), sampling.GumbelNoise(7, 50, 1.0)
    rows = a.rows([3, 4, 5])
    assert torch.equal(b.rows([5])[0], rows[2]) and torch.equal(b.rows([3, 4])[1], rows[1])   # any order
    a.forget(5)
    assert torch.equal(a.rows([3])[0], rows[0])                 # a forgotten row is drawn again, identically
    assert not torch.equal(sampling.GumbelNoise(8, 50, 1.0).rows([3])[0], rows[0])
    assert torch.allclose(sampling.GumbelNoise(7, 50, 0.5).rows([3])[0], rows[0] * 0.5)       # T folded in


def test_gumbel_choice_draws_from_the_warped_distribution():
    """Many positions' noise against one row of logits: the argmax frequencies follow softmax(z / T) restricted to
    the top-p nucleus; a plain argmax (no noise) would not."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    noise = sampling.GumbelNoise(0, 5, 0.7)
    n = 20_000
    for top_p in (1.0, 0.8):
        picks = sampling.gumbel_choice(logits.expand(n, -1), noise.rows(range(n)), 0.7, top_p)
        p = sampling.warp_probs(logits[None], 0.7, top_p)[0]
        counts = Counter(picks.tolist())
        assert all(counts[v] == 0 for v in range(5) if p[v] == 0)
        assert tv(counts, dict(enumerate(p.tolist())), n) < 0.015


@pytest.fixture(scope="module")
def flat():
    target = tiny_target(vocab=5, layers=3, hidden=16, eos=None, logit_scale=20.0)
    target.eos_token_ids = set()
    return target, [1, 2, 0], exact_distribution(target, [1, 2, 0], 3, 1.0)


def test_gumbel_speculative_sampling_matches_target_distribution(flat):
    target, prompt, exact = flat
    assert max(exact.values()) < 0.9
    drafter = Drafter.untrained(target, "domino", seed=0, block_size=3)
    counts = Counter(tuple(speculative_generate(target, drafter, prompt_ids=prompt, max_new_tokens=3,
                                                temperature=1.0, seed=s, sampler="gumbel").token_ids)
                     for s in range(N))
    assert tv(counts, exact, N) < 0.08


@pytest.mark.parametrize("method, opts, tree", [
    ("domino", {}, 0), ("dflash", {}, 0), ("eagle", {}, 0), ("domino", {"lookup": 1}, 0),
    ("domino", {"draft_cutoff": 0.5}, 0), ("domino", {"adaptive_drafts": True}, 0), ("domino", {}, 6),
    ("dflash", {"tree_min_prob": 0.05}, 6), ("domino", {"head_impl": "eager"}, 0)])
def test_every_drafter_samples_the_text_plain_decoding_samples(method, opts, tree):
    """Same seed, same text, token for token, at T = 0.8 and top-p 1 or 0.9 (a drafter only decides how many of
    the target's draws one forward checks)."""
    target = tiny_target(vocab=40, layers=2, hidden=32, eos=None, logit_scale=4.0)
    target.eos_token_ids = set()
    drafter = Drafter.untrained(target, method, seed=3, block_size=4).set_options(InferenceOptions(**opts))
    prompt = [5, 6, 7, 5, 6]
    for seed in range(4):
        for top_p in (1.0, 0.9):
            kw = dict(prompt_ids=prompt, max_new_tokens=24, temperature=0.8, top_p=top_p, seed=seed,
                      sampler="gumbel")
            plain = speculative_generate(target, None, **kw).token_ids
            spec = speculative_generate(target, drafter, tree_nodes=tree, **kw)
            assert spec.token_ids == plain, (seed, top_p)
            assert len(spec.steps) < len(plain) or tree == 0 and opts.get("adaptive_drafts")   # drafts were used



@pytest.mark.parametrize("method, tree", [("domino", 0), ("dflash", 0), ("domino", 6)])
def test_step_records_rank_the_scores_each_side_took_the_argmax_of(method, tree):
    """Under gumbel the stored top-k of drafter and target both hold logit + T·g: the target's top-1 is the token it
    chose at each verified position, the drafter's the token it drafted (the dashboard's inspector reads these)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from app.inspector import inspect_position

    target = tiny_target(vocab=40, layers=2, hidden=32, eos=None, logit_scale=4.0)
    target.eos_token_ids = set()
    drafter = Drafter.untrained(target, method, seed=3, block_size=4)
    kw = dict(prompt_ids=[5, 6, 7, 5, 6], max_new_tokens=24, topk=5, tree_nodes=tree)
    res = speculative_generate(target, drafter, temperature=0.8, seed=2, sampler="gumbel", **kw)
    checked = 0
    for s in res.steps:
        assert s.gumbel_scores
        chosen = s.draft_tokens[: s.accepted] + ([s.bonus] if s.bonus is not None else [])
        assert [ids[0] for ids in s.target_topk_ids[: len(chosen)]] == chosen
        if not s.copied and s.draft_tokens:
            assert s.final_topk_ids[0][0] == s.draft_tokens[0]
            checked += 1
    assert checked
    step = next(i for i, s in enumerate(res.steps) if s.draft_tokens) + 1
    texts = type("T", (), {"raw": staticmethod(str)})()
    assert any("gumbel sampler" in n for n in inspect_position(res.steps, texts, step, 1)["notes"])
    greedy = speculative_generate(target, drafter, **kw)
    assert not any(s.gumbel_scores for s in greedy.steps)
    assert not any("gumbel" in n for n in inspect_position(greedy.steps, texts, 1, 1)["notes"])

def test_shipped_drafters_sample_the_same_text():
    from domino_lab import Target
    from domino_lab.models import load_drafter

    default_target = Target.from_pretrained("default")
    kw = dict(prompt="def count_words(text):", max_new_tokens=48, temperature=1.0, seed=11, sampler="gumbel")
    plain = speculative_generate(default_target, None, **kw).token_ids
    for spec, tree in (("default", 0), ("default-dflash", 0), ("default", 16)):
        res = speculative_generate(default_target, load_drafter(spec, default_target), tree_nodes=tree, **kw)
        assert res.token_ids == plain and res.mean_acceptance_length > 1.0


def test_bad_sampler_and_sampled_tree_are_one_clear_error():
    target = tiny_target(vocab=20, layers=1, hidden=16)
    with pytest.raises(UserError, match="unknown sampler 'metropolis'"):
        speculative_generate(target, None, prompt_ids=[1, 2], max_new_tokens=2, temperature=1.0, sampler="metropolis")
    drafter = Drafter.untrained(target, "domino", block_size=3).set_options(InferenceOptions(tree_sampled=True))
    with pytest.raises(UserError, match="tree_sampled off or use the rejection sampler"):
        speculative_generate(target, drafter, prompt_ids=[1, 2], max_new_tokens=2, temperature=1.0, tree_nodes=4,
                             sampler="gumbel")


@pytest.mark.parametrize("method, opts, drafts", [(None, {}, "all"), ("domino", {}, "all"), ("dflash", {}, "adaptive"),
                                                  ("domino", {"lookup": 1}, "all")])
def test_batched_sampling_gives_each_row_its_own_sample(method, opts, drafts):
    """Batched decoding at T > 0 with the gumbel sampler: row r equals its prompt decoded alone with seed + r, for
    ragged prompts and rows that stop early at EOS, all at once or as a queue through fewer slots."""
    from domino_lab.decoding.batched import batched_generate

    target = tiny_target(vocab=40, layers=2, hidden=32, eos=3, logit_scale=4.0)
    drafter = None if method is None else Drafter.untrained(target, method, seed=2, block_size=4).set_options(
        InferenceOptions(**opts))
    prompts = [[5, 6, 7, 5, 6], [9], [1, 2, 1, 2, 1, 2, 8], [4, 4]]
    for top_p, slots in ((1.0, None), (0.9, None), (1.0, 2)):        # slots 2: a queue (rows replaced as they end)
        res = batched_generate(target, drafter, prompts, max_new_tokens=20, drafts=drafts, temperature=0.9,
                               top_p=top_p, seed=10, sampler="gumbel", slots=slots)
        for r, p in enumerate(prompts):
            alone = speculative_generate(target, None, prompt_ids=p, max_new_tokens=20, temperature=0.9, top_p=top_p,
                                         seed=10 + r, sampler="gumbel")
            assert res.token_ids[r] == alone.token_ids, (r, top_p)
    assert any(len(t) < 20 for t in res.token_ids)          # a row stopped at EOS and left the batch


def test_batched_sampling_needs_the_gumbel_sampler():
    from domino_lab.decoding.batched import batched_generate

    target = tiny_target(vocab=20, layers=1, hidden=16)
    with pytest.raises(UserError, match="gumbel sampler only"):
        batched_generate(target, None, [[1, 2]], max_new_tokens=2, temperature=1.0)
