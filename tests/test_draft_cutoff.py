"""The draft-length cutoff: verify only the drafts likely to be accepted. Greedy stays lossless, sampling stays
exact (how many drafts are verified depends on the drafter's own probabilities, never on the target), and the
cutoff really shortens what is verified."""

import pytest
import torch

from domino_lab import Drafter, Target, speculative_generate
from domino_lab.data.eval_sets import load_eval_set
from domino_lab.errors import UserError
from domino_lab.models import load_drafter
from domino_lab.models.options import InferenceOptions
from domino_lab.sampling import confident_prefix
from core_helpers import tiny_target
from test_sampling import exact_distribution, sample_many, tv


def test_confident_prefix_keeps_the_likely_prefix():
    # top-1 probabilities 0.9, 0.8, 0.5, 0.9 (second logit = log of the rest): prefix products .9 .72 .36 .324
    p = torch.tensor([0.9, 0.8, 0.5, 0.9])
    logits = torch.stack([p.log(), (1 - p).log()], dim=-1)
    assert confident_prefix(logits, 0.5) == 2
    assert confident_prefix(logits, 0.3) == 4
    assert confident_prefix(logits, 0.95) == 1          # at least one draft is always verified
    assert confident_prefix(logits, 0.0) == 4


@pytest.fixture(scope="module")
def embedded():
    t = Target.from_pretrained("default", dtype="float32")
    prompts = [load_eval_set(s, limit=2)[i]["prompt"] for s in ("math", "humaneval", "unseen") for i in range(2)]
    return t, prompts


@pytest.mark.parametrize("spec", ["default", "default-dflash", "default-eagle"])
def test_greedy_with_a_cutoff_is_lossless_and_verifies_fewer_tokens(embedded, spec):
    t, prompts = embedded
    full = load_drafter(spec, t)
    cut = load_drafter(spec, t, options=InferenceOptions(draft_cutoff=0.3))
    verified = {"full": 0, "cut": 0}
    for prompt in prompts:
        plain = speculative_generate(t, None, prompt=prompt, max_new_tokens=40).token_ids
        a = speculative_generate(t, full, prompt=prompt, max_new_tokens=40)
        b = speculative_generate(t, cut, prompt=prompt, max_new_tokens=40)
        assert a.token_ids == plain and b.token_ids == plain, prompt
        verified["full"] += sum(len(s.draft_tokens) for s in a.steps)
        verified["cut"] += sum(len(s.draft_tokens) for s in b.steps)
        assert all(len(s.draft_tokens) >= 1 for s in b.steps[:-1])
    assert verified["cut"] < 0.9 * verified["full"], verified


def test_sampling_with_a_cutoff_matches_the_target_distribution():
    t = tiny_target(vocab=5, layers=3, hidden=16, eos=None, logit_scale=60.0)
    t.eos_token_ids = set()
    prompt = [1, 2, 0]
    exact = exact_distribution(t, prompt, 3, 1.0)
    d = Drafter.untrained(t, "domino", seed=0, block_size=4).set_options(InferenceOptions(draft_cutoff=0.08))
    lengths = {len(s.draft_tokens) for seed in range(40) for s in speculative_generate(
        t, d, prompt_ids=prompt, max_new_tokens=8, temperature=1.0, seed=seed).steps}
    assert len(lengths) > 1                 # the cutoff really varies how many drafts are verified
    n = 1000
    assert tv(sample_many(t, d, prompt, n), exact, n) < 0.08


def test_step_records_without_top_k_verify_the_same_drafts(embedded):
    """The cutoff reads the drafter's own top-k, not the records': a decode that stores no top-k (the default)
    verifies exactly the drafts that one storing them does, and its records stay empty of them."""
    t, prompts = embedded
    cut = load_drafter("default", t, options=InferenceOptions(draft_cutoff=0.3))
    for p in prompts[:3]:
        lean = speculative_generate(t, cut, prompt=p, max_new_tokens=40)
        full = speculative_generate(t, cut, prompt=p, max_new_tokens=40, topk=5)
        assert [s.draft_tokens for s in lean.steps] == [s.draft_tokens for s in full.steps]
        assert all(len(s.target_topk_ids) == len(s.draft_tokens) + 1 for s in full.steps)
        # one drafter top-k per verified draft, as for the target's rows: the cut-off drafts leave none behind
        assert all(len(s.base_topk_ids) == len(s.final_topk_ids) == len(s.draft_tokens) for s in full.steps)
        assert any(len(s.draft_tokens) < cut.config.num_drafts for s in full.steps)
        assert not any(s.target_topk_ids or s.base_topk_ids for s in lean.steps)
    with pytest.raises(UserError, match="topk must be a whole number >= 0"):
        speculative_generate(t, cut, prompt=prompts[0], max_new_tokens=4, topk=-1)
