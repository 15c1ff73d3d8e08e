"""The fast Domino head (input table, candidate pool, compiled rollout, fused C++ loop) against the eager
reference."""
import pytest
import torch
import torch.nn.functional as F

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
    d.set_head(impl, pool)
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


@pytest.mark.parametrize("impl,pool", [("eager", 0), ("fast", 0), ("fast", 6), ("compiled", 6), ("fused", 0),
                                       ("fused", 6)])
def test_greedy_stays_lossless(target, trained, impl, pool):
    trained.set_head(impl, pool)
    taus = []
    for p in PROMPTS:
        plain = speculative_generate(target, None, prompt_ids=p, max_new_tokens=20).token_ids
        res = speculative_generate(target, trained, prompt_ids=p, max_new_tokens=20)
        assert res.token_ids == plain, (impl, pool, p)
        taus.append(res.mean_acceptance_length)
    assert sum(taus) / len(taus) > 1.0


def assert_drafts_like_fast(d, impl, pools, feats, anchor, ctx) -> list:
    """`impl` drafts the tokens, and ranks the final top-k ids, of the torch fast path at every pool size."""
    drafts = []
    for pool in pools:
        f = draft_with(d, "fast", pool, feats, anchor, ctx)
        drafts.append(draft_with(d, impl, pool, feats, anchor, ctx))
        assert torch.equal(f.tokens, drafts[-1].tokens), (impl, pool)
        assert torch.equal(f.final_topk[0], drafts[-1].final_topk[0]), (impl, pool)
    return drafts


def test_compiled_rollout_equals_fast(target, trained):
    g = torch.Generator().manual_seed(2)
    feats = torch.randn(2, 9, len(trained.config.target_layer_ids) * 32, generator=g, dtype=torch.float64)
    assert_drafts_like_fast(trained, "compiled", (0, 6), feats, torch.tensor([7, 42]), 9)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_rollout_equals_fast(dtype, trained):
    """The C++ loop drafts what the torch fast path drafts (full vocabulary, pools, a batch of rows, FR-Spec) and
    ranks the same final top-k; at T > 0 it samples in the loop as well (see the next test)."""
    d = trained if dtype == torch.float64 else Drafter.untrained(tiny_target(vocab=100, hidden=32, dtype=dtype),
                                                                 "domino", seed=3, block_size=8, num_layers=1)
    tol = 1e-9 if dtype == torch.float64 else 1e-4
    g = torch.Generator().manual_seed(4)
    for trial in range(4):
        ctx = 4 + 5 * trial
        feats = torch.randn(3, ctx, len(d.config.target_layer_ids) * 32, generator=g, dtype=dtype)
        anchor = torch.randint(0, 99, (3,), generator=g)
        for pool in (0, 6, 100):
            f = draft_with(d, "fast", pool, feats, anchor, ctx)
            u = draft_with(d, "fused", pool, feats, anchor, ctx)
            assert torch.equal(f.tokens, u.tokens), (trial, pool)
            assert torch.equal(f.final_topk[0], u.final_topk[0])
            assert torch.allclose(f.final_topk[1], u.final_topk[1], atol=tol)
            assert torch.equal(f.base_topk[0], u.base_topk[0])
        d.set_head("fused")
        sampled = [d.draft(feats, 0, anchor, ctx, None, temperature=1.0, generator=torch.Generator().manual_seed(5))
                   for _ in range(2)]              # sampled in the loop too: a seed reproduces its drafts
        assert torch.equal(sampled[0].tokens, sampled[1].tokens) and torch.equal(sampled[0].q, sampled[1].q)
        assert (sampled[0].q.gather(-1, sampled[0].tokens.unsqueeze(-1)) > 0).all()
    d.set_head("fused")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("frspec", [False, True])
def test_fused_sampled_rollout_draws_from_the_heads_own_q(dtype, frspec):
    """At T > 0 the loop's q for every slot is softmax(final logits / T), cut to the top-p nucleus, of the head run
    teacher-forced on the prefix it drew (nn.GRU, the full correction), over the FR-Spec list when there is one; its
    samples follow q."""
    from domino_lab.sampling import warp_probs
    from domino_lab.models.domino_head import DominoHead

    torch.manual_seed(0)
    V, H, n, b = 60, 16, 5, 3
    head = DominoHead(H, 12, 6, V).to(dtype)
    emb = torch.randn(V, H, dtype=dtype)
    ids = torch.arange(2, V, 3) if frspec else None
    h = torch.randn(b, n, H, dtype=dtype)
    base = 2 * torch.randn(b, n, V if ids is None else len(ids), dtype=dtype)
    anchor = torch.tensor([0, 7, 59])
    top = base.topk(3)
    assert head.fused_weights(emb) is not None            # the loop runs here (no fallback to the torch path)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for temp, top_p in ((0.6, 1.0), (1.7, 1.0), (1.0, 0.7), (1.7, 0.3)):
        r = head.rollout(h, base, anchor, emb, n, (top.indices, top.values), temperature=temp, top_p=top_p,
                         generator=torch.Generator().manual_seed(3), impl="fused", vocab_ids=ids)
        prefix = torch.cat([anchor[:, None], r.tokens[:, :-1]], 1)
        with torch.no_grad():
            s = head.prefix_states(F.embedding(prefix, emb))
            delta = head.correction(h, s)
        final = base.clone()
        final[:, 1:] += (delta if ids is None else delta[..., ids])[:, 1:]
        want = warp_probs(final.flatten(0, 1), temp, top_p).view(b, n, -1)
        if top_p < 1:
            assert ((r.q > 0).sum(-1) < final.shape[-1]).all()      # the nucleus cut something in every slot
        if ids is not None:
            want = torch.zeros(b, n, V, dtype=torch.float64).index_copy_(-1, ids, want)
            assert set(r.tokens.flatten().tolist()) <= set(ids.tolist())
        assert torch.allclose(r.q, want, atol=tol), (r.q - want).abs().max()
        assert (r.q.gather(-1, r.tokens.unsqueeze(-1)) > 0).all()
    # the draws follow q: slot 0 (the base softmax, which does not depend on earlier draws) over many seeds
    for top_p in (1.0, 0.6):
        counts = torch.zeros(V, dtype=torch.float64)
        for seed in range(3000):
            r = head.rollout(h[:1], base[:1], anchor[:1], emb, 1, (top.indices[:1], top.values[:1]), temperature=1.0,
                             top_p=top_p, generator=torch.Generator().manual_seed(seed), impl="fused", vocab_ids=ids)
            counts[r.tokens[0, 0]] += 1
        assert counts[r.q[0, 0] == 0].sum() == 0 and 0.5 * (counts / 3000 - r.q[0, 0]).abs().sum() < 0.05


def test_fused_rollout_under_frspec_equals_fast(target):
    from domino_lab.models.frspec import restrict
    d = Drafter.untrained(target, "domino", seed=5, block_size=6, num_layers=1)
    ids = list(range(3, 100, 3))
    d = restrict(d, ids)
    g = torch.Generator().manual_seed(6)
    feats = torch.randn(2, 7, len(d.config.target_layer_ids) * 32, generator=g, dtype=torch.float64)
    for u in assert_drafts_like_fast(d, "fused", (0, 5), feats, torch.tensor([4, 50]), 7):
        assert set(u.tokens.flatten().tolist()) <= set(ids)


def test_fused_kernel_is_built_once_and_bound_to_the_weights(monkeypatch, tmp_path, trained):
    import os
    import shutil
    from domino_lab.models import head_kernel
    if not (os.environ.get("CXX") or any(shutil.which(c) for c in ("c++", "g++", "clang++"))):
        pytest.skip("no C++ compiler (apt-get install g++): nothing to build; the fallback test below covers "
                    "what such a machine runs")
    monkeypatch.setenv("DOMINO_LAB_CACHE", str(tmp_path / "cache"))
    path = head_kernel.build()
    assert path.parent == tmp_path / "cache" / "kernels" and path.exists()
    assert [p.name for p in path.parent.iterdir()] == [path.name]        # no temporary build folder left behind
    stamp = path.stat().st_mtime_ns
    assert head_kernel.build() == path and path.stat().st_mtime_ns == stamp       # cached: not rebuilt
    # an anchor outside the vocabulary is refused before the loop reads memory
    h = torch.zeros(1, 8, 32, dtype=torch.float64)
    fw = trained.head.fused_weights(trained.target.embed_tokens.weight)
    with pytest.raises(IndexError, match="anchor"):
        head_kernel.fused_greedy_rollout(fw, h, trained.lm_head(h), torch.tensor([100]), 6)
    # a weight update rebinds the loop to the new weights
    with torch.no_grad():
        trained.head.w2.weight.mul_(2.0)
    try:
        assert trained.head.fused_weights(trained.target.embed_tokens.weight) is not fw
    finally:
        with torch.no_grad():
            trained.head.w2.weight.div_(2.0)
    import copy
    copy.deepcopy(trained)          # a head that has cached the fused loop still copies (and pickles)


def test_fused_head_falls_back_without_a_compiler(monkeypatch, tmp_path, target, trained):
    """No compiler: one warning, then the torch path with the same drafts (runs with or without one installed)."""
    from domino_lab.models import head_kernel
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("DOMINO_LAB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setattr(head_kernel, "_lib", None)
    fresh = Drafter.untrained(target, "domino", seed=3, block_size=8, num_layers=1)
    fresh.load_state_dict(trained.state_dict())
    g = torch.Generator().manual_seed(7)
    feats = torch.randn(2, 9, len(trained.config.target_layer_ids) * 32, generator=g, dtype=torch.float64)
    anchor = torch.tensor([7, 42])
    with pytest.warns(UserWarning, match="fused.*unavailable"):
        u = draft_with(fresh, "fused", 6, feats, anchor, 9)
    assert head_kernel._lib is False
    assert torch.equal(u.tokens, draft_with(trained, "fast", 6, feats, anchor, 9).tokens)


def test_sampling_ignores_the_pool_and_keeps_the_target_distribution():
    """T > 0 with a 2-token pool out of 5 set: the pool is greedy-only, so q covers the whole vocabulary (a pool
    would leave it no mass where p has some), and the output is p."""
    from test_sampling import exact_distribution
    target = tiny_target(vocab=5, layers=3, hidden=16, eos=None, logit_scale=60.0)
    target.eos_token_ids = set()
    drafter = Drafter.untrained(target, "domino", seed=0, block_size=2).set_head("fast", 2)
    prompt = [1, 2, 0]
    exact = exact_distribution(target, prompt, 3, 1.0)
    counts = sample_many(target, drafter, prompt, N // 2)
    # sampling noise at N/2 draws is ~0.05 TV (0.027 at 1500 in test_sampling); a wrong rule gives ~0.7
    assert tv(counts, exact, N // 2) < 0.08
    # q of the corrected drafts covers more than the 2-token pool and sums to 1; each draft lies in its support
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(3, 4, len(drafter.config.target_layer_ids) * 16, generator=g, dtype=torch.float64)
    dr = drafter.draft(feats, 0, torch.tensor([0, 1, 2]), 4, None, temperature=1.0, generator=g)
    assert ((dr.q[:, 1] > 0).sum(-1) > 2).all() and ((dr.q[:, 0] > 0).sum(-1) > 2).any()
    assert torch.allclose(dr.q.sum(-1), torch.ones(3, 2, dtype=torch.float64))
    assert (dr.q.gather(-1, dr.tokens.unsqueeze(-1)) > 0).all()


def test_bad_inference_options_are_user_errors(target):
    from domino_lab.errors import UserError
    d = Drafter.untrained(target, "domino")
    with pytest.raises(UserError, match="head implementation"):
        d.set_head("turbo")
    with pytest.raises(UserError, match="candidate pool"):
        d.set_head(candidate_pool=-1)
    with pytest.raises(UserError, match="unknown drafter option"):       # runtime choices are not architecture
        Drafter.untrained(target, "domino", head_impl="fast")


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
    assert "| 512 | 4 |" in md and "fast K=64" in md and "fused K=64" in md


def test_correcting_the_first_draft_keeps_every_path_equal_and_lossless(target):
    """correct_first: the head also corrects draft 0. Every inference path drafts what the eager reference drafts,
    slot 0 included, the records keep showing the uncorrected base, and chains and trees stay lossless."""
    from domino_lab.errors import UserError
    from domino_lab.models.export import check_exportable

    d = Drafter.untrained(target, "domino", seed=3, block_size=8, num_layers=1, correct_first=True)
    brief_train(d, greedy_sequences(target, 16, 32), steps=30)
    g = torch.Generator().manual_seed(2)
    feats = torch.randn(4, 9, len(d.config.target_layer_ids) * 32, generator=g, dtype=torch.float64)
    anchor = torch.randint(0, 99, (4,), generator=g)
    e = draft_with(d, "eager", 0, feats, anchor, 9)
    for impl in ("fast", "fused"):
        assert_drafts_like_fast(d, impl, (0, 6), feats, anchor, 9)
        assert torch.equal(draft_with(d, impl, 0, feats, anchor, 9).tokens, e.tokens)
    # slot 0's final logits are not its base logits, and the record's base top-k is the uncorrected one
    assert not torch.allclose(e.final_topk[1][:, 0], e.base_topk[1][:, 0])
    d.head.correct_first = False
    assert torch.equal(draft_with(d, "eager", 0, feats, anchor, 9).base_topk[1], e.base_topk[1])
    d.head.correct_first = True
    for impl in ("fast", "fused"):
        d.set_head(impl, 0)
        for p in PROMPTS[:6]:
            plain = speculative_generate(target, None, prompt_ids=p, max_new_tokens=20).token_ids
            assert speculative_generate(target, d, prompt_ids=p, max_new_tokens=20).token_ids == plain, (impl, p)
            assert speculative_generate(target, d, prompt_ids=p, max_new_tokens=20, tree_nodes=16).token_ids == plain
    with pytest.raises(UserError, match="correct_first"):
        check_exportable(d.config, "domino")
    with pytest.raises(UserError, match="correct_first is an option of the Domino head"):
        Drafter.untrained(target, "dflash", seed=3, block_size=8, num_layers=1, correct_first=True)
