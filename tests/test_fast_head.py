"""Issue 10: the fast Domino head (input table, candidate pool, compiled rollout) against the eager reference."""
import pytest
import torch

from domino_lab import Drafter, speculative_generate
from domino_lab.models.domino_head import gru_cell
from core_helpers import brief_train, greedy_sequences, tiny_target
from test_sampling import N, sample_many, tv

PROMPTS = [[(5 * i + j * 11) % 90 + 4 for j in range(3 + i % 4)] for i in range(12)]


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab=100, hidden=32)


@pytest.fixture(scope="module")
def trained(target):
    d = Drafter.untrained(target, "domino", seed=3, block_size=8, num_layers=1)
    brief_train(d, greedy_sequences(target, 16, 32), steps=30)
    return d


def draft_with(d, impl, pool, feats, anchor, ctx):
    d.config.head_impl, d.config.candidate_pool = impl, pool
    return d.draft(feats, 0, anchor, ctx, None)


def test_gru_cell_matches_nn_gru():
    torch.manual_seed(0)
    gru = torch.nn.GRU(12, 20, bias=False, batch_first=True).double()
    x = torch.randn(3, 6, 12, dtype=torch.float64)
    ref, _ = gru(x)
    gi = x @ gru.weight_ih_l0.t()
    state, outs = None, []
    for t in range(x.shape[1]):
        gh = None if state is None else state @ gru.weight_hh_l0.t()
        state = gru_cell(gi[:, t], gh, state)
        outs.append(state)
    assert torch.allclose(torch.stack(outs, 1), ref, atol=1e-12)


def test_fast_k0_equals_eager_on_random_inputs(target, trained):
    g = torch.Generator().manual_seed(1)
    for trial in range(5):
        ctx = 5 + 7 * trial
        feats = torch.randn(4, ctx, len(trained.config.target_layer_ids) * 32, generator=g, dtype=torch.float64)
        anchor = torch.randint(0, 99, (4,), generator=g)
        e = draft_with(trained, "eager", 0, feats, anchor, ctx)
        f = draft_with(trained, "fast", 0, feats, anchor, ctx)
        assert torch.equal(e.tokens, f.tokens)
        assert torch.equal(e.final_topk[0], f.final_topk[0])
        assert torch.allclose(e.final_topk[1], f.final_topk[1], atol=1e-9)
        assert torch.equal(e.base_topk[0], f.base_topk[0])
        # a pool as large as the vocabulary is the exact head too; a small pool may differ but only on the pool
        p = draft_with(trained, "fast", 100, feats, anchor, ctx)
        assert torch.equal(p.tokens, e.tokens)
        small = draft_with(trained, "fast", 8, feats, anchor, ctx)
        assert torch.equal(small.tokens[:, 0], e.tokens[:, 0])     # draft 0 is uncorrected: full base argmax


def test_input_table_follows_weight_updates(trained):
    head, emb = trained.head, trained.target.embed_tokens.weight
    before = head.fast_weights(emb)[0].clone()
    with torch.no_grad():
        head.gru.weight_ih_l0.mul_(1.5)
    try:
        assert torch.allclose(head.fast_weights(emb)[0], before * 1.5)
    finally:
        with torch.no_grad():
            head.gru.weight_ih_l0.div_(1.5)
    assert torch.allclose(head.fast_weights(emb)[0], before)


@pytest.mark.parametrize("impl,pool", [("eager", 0), ("fast", 0), ("fast", 6), ("compiled", 6)])
def test_greedy_stays_lossless(target, trained, impl, pool):
    trained.config.head_impl, trained.config.candidate_pool = impl, pool
    taus = []
    for p in PROMPTS:
        plain = speculative_generate(target, None, prompt_ids=p, max_new_tokens=20).token_ids
        res = speculative_generate(target, trained, prompt_ids=p, max_new_tokens=20)
        assert res.token_ids == plain, (impl, pool, p)
        taus.append(res.mean_acceptance_length)
    assert sum(taus) / len(taus) > 1.0


def test_compiled_rollout_equals_fast(target, trained):
    g = torch.Generator().manual_seed(2)
    feats = torch.randn(2, 9, len(trained.config.target_layer_ids) * 32, generator=g, dtype=torch.float64)
    anchor = torch.tensor([7, 42])
    for pool in (0, 6):
        f = draft_with(trained, "fast", pool, feats, anchor, 9)
        c = draft_with(trained, "compiled", pool, feats, anchor, 9)
        assert torch.equal(f.tokens, c.tokens)
        assert torch.equal(f.final_topk[0], c.final_topk[0])


def test_sampling_with_a_pool_keeps_the_target_distribution():
    """T > 0 with a 2-token pool out of 5: q is the pool softmax the drafts came from, so the output is p."""
    from test_sampling import exact_distribution
    target = tiny_target(vocab=5, layers=3, hidden=16, eos=None, logit_scale=60.0)
    target.eos_token_ids = set()
    drafter = Drafter.untrained(target, "domino", seed=0, block_size=2, head_impl="fast", candidate_pool=2)
    prompt = [1, 2, 0]
    exact = exact_distribution(target, prompt, 3, 1.0)
    counts = sample_many(target, drafter, prompt, N // 2)
    # sampling noise at N/2 draws is ~0.05 TV (0.027 at 1500 in test_sampling); a wrong rule gives ~0.7
    assert tv(counts, exact, N // 2) < 0.08
    # q of the corrected drafts lives on the pool and sums to 1; each draft lies in its q's support
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(3, 4, len(drafter.config.target_layer_ids) * 16, generator=g, dtype=torch.float64)
    dr = drafter.draft(feats, 0, torch.tensor([0, 1, 2]), 4, None, temperature=1.0, generator=g)
    assert ((dr.q[:, 1] > 0).sum(-1) <= 2).all() and ((dr.q[:, 0] > 0).sum(-1) > 2).any()
    assert torch.allclose(dr.q.sum(-1), torch.ones(3, 2, dtype=torch.float64))
    assert (dr.q.gather(-1, dr.tokens.unsqueeze(-1)) > 0).all()


def test_config_rejects_bad_head_options(target):
    from domino_lab.errors import UserError
    with pytest.raises(UserError, match="head_impl"):
        Drafter.untrained(target, "domino", head_impl="turbo")
    with pytest.raises(UserError, match="candidate_pool"):
        Drafter.untrained(target, "domino", candidate_pool=-1)


def test_microbench_quick(tmp_path):
    import importlib.util
    import sys
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "experiments" / "head_microbench.py"
    spec = importlib.util.spec_from_file_location("head_microbench", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["head_microbench"] = mod
    spec.loader.exec_module(mod)
    assert mod.main(["--quick", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "head_microbench.md").read_text()
    assert "| 512 | 4 |" in md and "fast K=64" in md
