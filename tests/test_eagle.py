"""The EAGLE-style chain drafter (method `eagle`) and the FR-Spec draft vocabulary.

Lossless through the real engine, training-time test == inference chain, a brief training run helps,
checkpoints round-trip; FR-Spec maps ids both ways, keeps greedy decoding lossless for every method and keeps
T > 0 sampling exact (q is zero outside the subset).
"""
import pytest
import torch

from domino_lab import Drafter, speculative_generate
from domino_lab.errors import UserError
from domino_lab.models.drafter import load_drafter
from domino_lab.models.eagle import eagle_chain, ttt_hidden
from domino_lab.models.frspec import frequent_tokens, q_to_vocab, to_vocab
from core_helpers import brief_train, greedy_sequences, tiny_target
from test_sampling import exact_distribution, sample_many, tv

PROMPTS = [[(7 * i + j * 13) % 60 + 4 for j in range(3 + i % 5)] for i in range(12)]
NEW = 24


@pytest.fixture(scope="module")
def plain(target):
    return {tuple(p): speculative_generate(target, None, prompt_ids=p, max_new_tokens=NEW).token_ids for p in PROMPTS}


@pytest.fixture(scope="module")
def seqs(target):
    return greedy_sequences(target, 24, 40)


def mean_tau(target, drafter, prompts=PROMPTS) -> float:
    res = [speculative_generate(target, drafter, prompt_ids=p, max_new_tokens=NEW) for p in prompts]
    return sum(sum(r.acceptance_lengths) for r in res) / sum(len(r.steps) for r in res)


def assert_lossless(target, plain, drafter, prompts=PROMPTS, **kw):
    for p in prompts:
        res = speculative_generate(target, drafter, prompt_ids=p, max_new_tokens=NEW, **kw)
        assert res.token_ids == plain[tuple(p)], p
        assert res.target_forward_calls == len(res.steps) + 1


@pytest.fixture(scope="module")
def trained_eagle(target, seqs):
    d = Drafter.untrained(target, "eagle", seed=1, block_size=8)
    brief_train(d, seqs, steps=60)
    return d


# ---- eagle -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block,shift", [(1, True), (2, True), (4, True), (8, True), (4, False), (8, False)])
def test_untrained_eagle_is_lossless(target, plain, block, shift):
    d = Drafter.untrained(target, "eagle", seed=block, block_size=block, shift_label=shift)
    assert d.config.num_drafts == (block if shift else block - 1)      # the block drafters' token budget
    assert_lossless(target, plain, d, PROMPTS[block % 4::4])


def test_ttt_unroll_equals_the_inference_chain(target, seqs):
    """Training-time test must compute exactly what the chain computes at inference (same features, same
    attention pattern, same positions) when it is fed the same tokens."""
    from transformers import DynamicCache

    d = Drafter.untrained(target, "eagle", seed=0, block_size=4)
    feats = target.forward(seqs[:1], taps=d.config.target_layer_ids).features
    anchors = (5, 17, 30)
    outs = ttt_hidden(d.chain, d.embed, feats, seqs[:1], 4, torch.tensor([anchors]) - 1)
    for c, a in enumerate(anchors):
        got = []

        def pick(i, h):
            got.append(h)
            return seqs[0:1, a + 1 + i]            # teacher-forced chain
        cache = DynamicCache()
        eagle_chain(d, feats[:, :a - 3], seqs[:1, :a - 3], seqs[0, a - 3:a - 2], a - 3, cache, 1, lambda i, h: h[:, 0])
        # a second call appends the remaining context rows to the same cache, as the engine does each round
        eagle_chain(d, feats[:, a - 3:a], seqs[:1, a - 3:a], seqs[0, a:a + 1], a, cache, 4, pick)
        assert cache.get_seq_length() == a                                   # draft rows cropped off
        for j in range(4):
            torch.testing.assert_close(got[j][0], outs[0, c, j])


def test_brief_training_raises_tau(target, plain, trained_eagle):
    untrained = mean_tau(target, Drafter.untrained(target, "eagle", seed=1, block_size=8), PROMPTS[:8])
    trained = mean_tau(target, trained_eagle, PROMPTS[:8])
    # measured: 1.01 untrained -> 1.27 after 40 steps (dflash under the same brief training: 1.19)
    assert trained > untrained + 0.15, (untrained, trained)
    assert_lossless(target, plain, trained_eagle, PROMPTS[8:])


def test_eagle_save_load_and_registry(target, trained_eagle, tmp_path):
    out = trained_eagle.save_pretrained(tmp_path / "eagle")
    back = Drafter.from_pretrained(out, target)
    assert back.config.method == "eagle"
    for p in PROMPTS[:4]:
        a = speculative_generate(target, trained_eagle, prompt_ids=p, max_new_tokens=NEW)
        b = speculative_generate(target, back, prompt_ids=p, max_new_tokens=NEW)
        assert a.token_ids == b.token_ids and a.acceptance_lengths == b.acceptance_lengths
    d = load_drafter("untrained:eagle:block_size=4", target)
    assert d.config.method == "eagle" and d.config.block_size == 4 and not d.has_head
    # checkpoints written before the families were split named the chain `backbone`: they still load
    legacy = {k.replace("chain.", "backbone.", 1): v for k, v in trained_eagle.state_dict().items()}
    d2 = Drafter(trained_eagle.config, target)
    d2.load_state_dict(legacy, strict=True)
    assert all(torch.equal(a, b) for a, b in zip(d2.state_dict().values(), trained_eagle.state_dict().values()))
    with pytest.raises(UserError, match="one decoder layer"):
        Drafter.untrained(target, "eagle", num_layers=2)


def test_batched_refuses_eagle(target, trained_eagle):
    from domino_lab.decoding.batched import batched_generate

    with pytest.raises(UserError, match="eagle"):
        batched_generate(target, trained_eagle, PROMPTS[:2], max_new_tokens=8)


def test_eagle_trains_through_the_module_objective(target, seqs):
    """The shared objective gives eagle the block layout: [b, N, n, V] logits, anchor 0 never supervised."""
    from domino_lab.training.objective import sample_anchors

    d = Drafter.untrained(target, "eagle", block_size=4)
    lm = torch.ones_like(seqs)
    feats = target.forward(seqs, taps=d.config.target_layer_ids).features
    anchors, keep = sample_anchors(lm, 6, torch.Generator().manual_seed(0))
    anchors[0, 0] = 0
    bb = d.training_blocks(feats, seqs, lm, anchors, keep)
    assert bb.logits_base.shape == (*anchors.shape, 4, target.vocab_size)
    assert not bb.valid[0, 0].any()
    a = int(anchors[1, 2])
    assert bb.labels[1, 2].tolist() == seqs[1, a + 1: a + 5].tolist()


# ---- FR-Spec ----------------------------------------------------------------------------------------
def test_frequent_tokens_and_id_mapping(target, seqs, tmp_path):
    rows = [{"input_ids": [5, 5, 7, 9, 9, 9], "loss_mask": [0, 1, 1, 1, 1, 1]}]
    assert frequent_tokens(rows, 2, 16) == [5, 9]               # supervised counts: 9 x3, 5 x1, 7 x1 (tie: smaller id)
    assert frequent_tokens(rows, 5, 16) == [0, 1, 5, 7, 9]      # too few distinct tokens: smallest unseen ids fill
    prompts = [{"input_ids": [12, 12, 3, 9, 9], "loss_mask": [0, 0, 0, 1, 1]}, {"input_ids": [3, 12, 7], "loss_mask": [0, 0, 1]}]
    # supervised first (9, 7), then the prompts' most frequent (12 x3 before 3 x2), then the smallest unseen id
    assert frequent_tokens(prompts, 3, 16) == [7, 9, 12]
    assert frequent_tokens(prompts, 5, 16) == [0, 3, 7, 9, 12]
    ids = [3, 10, 20, 33, 41, 50, 60]
    d = Drafter.untrained(target, "domino", block_size=4, frspec_k=len(ids)).set_frspec(list(reversed(ids)))
    assert d.draft_vocab.tolist() == ids                          # stored sorted
    assert to_vocab(torch.arange(len(ids)), d.draft_vocab).tolist() == ids
    q = torch.softmax(torch.randn(2, len(ids), dtype=torch.float64), -1)
    full = q_to_vocab(q, d.draft_vocab, target.vocab_size)
    assert full.shape[-1] == target.vocab_size and torch.allclose(full[:, ids], q) and float(full.sum()) == pytest.approx(2)
    back = Drafter.from_pretrained(d.save_pretrained(tmp_path / "fr"), target)
    assert back.draft_vocab.tolist() == ids
    with pytest.raises(UserError, match="distinct"):
        d.set_frspec([1, 1, 2, 3, 4, 5, 6])
    # every draft is inside the subset
    for p in PROMPTS[:3]:
        res = speculative_generate(target, d, prompt_ids=p, max_new_tokens=NEW)
        assert all(t in ids for s in res.steps for t in s.draft_tokens)


def test_frspec_full_vocabulary_is_exact(target):
    """K = V (every id) must draft exactly what the unrestricted drafter drafts: the mapping adds nothing."""
    for method in ("dflash", "domino", "eagle"):
        a = Drafter.untrained(target, method, seed=3, block_size=4)
        b = Drafter.untrained(target, method, seed=3, block_size=4, frspec_k=target.vocab_size)
        for p in PROMPTS[:3]:
            ra = speculative_generate(target, a, prompt_ids=p, max_new_tokens=NEW)
            rb = speculative_generate(target, b, prompt_ids=p, max_new_tokens=NEW)
            assert [s.draft_tokens for s in ra.steps] == [s.draft_tokens for s in rb.steps], method


@pytest.mark.parametrize("method", ["dflash", "domino", "eagle"])
def test_frspec_greedy_is_lossless(target, plain, seqs, method):
    d = Drafter.untrained(target, method, seed=2, block_size=8, frspec_k=24)
    rows = [{"input_ids": s.tolist(), "loss_mask": [0] * 4 + [1] * (len(s) - 4)} for s in seqs]
    d.set_frspec(frequent_tokens(rows, 24, target.vocab_size))
    brief_train(d, seqs, steps=30)
    assert_lossless(target, plain, d)
    if method == "domino":
        for impl, pool in (("eager", 0), ("fast", 0), ("fast", 6)):
            d.set_head(impl, pool)
            assert_lossless(target, plain, d, PROMPTS[:6])
        # the fast head without a pool drafts exactly what the eager reference drafts
        d.set_head("fast", 0)
        fast = [s.draft_tokens for p in PROMPTS[:4] for s in speculative_generate(
            target, d, prompt_ids=p, max_new_tokens=NEW).steps]
        d.set_head("eager", 0)
        eager = [s.draft_tokens for p in PROMPTS[:4] for s in speculative_generate(
            target, d, prompt_ids=p, max_new_tokens=NEW).steps]
        assert fast == eager
    assert mean_tau(target, d) > 1.2       # the restricted drafter still gets drafts accepted


@pytest.fixture(scope="module")
def peaked():
    # the test_sampling setup: a peaked 5-token target, so p and the (restricted) q differ a lot
    t = tiny_target(vocab=5, layers=3, hidden=16, eos=None, logit_scale=60.0)
    t.eos_token_ids = set()
    prompt = [1, 2, 0]
    return t, prompt, exact_distribution(t, prompt, 3, 1.0)


@pytest.mark.parametrize("method,impl", [("domino", "fast"), ("domino", "eager"), ("eagle", None)])
def test_frspec_sampling_matches_target_distribution(peaked, method, impl):
    t, prompt, exact = peaked
    d = Drafter.untrained(t, method, seed=0, block_size=2, frspec_k=3).set_frspec([0, 2, 4])
    if impl:
        d.set_head(impl)
    g = torch.Generator().manual_seed(0)
    dr = d.draft(t.forward(torch.tensor([prompt]), taps=d.config.target_layer_ids).features, 0,
                 torch.tensor([1]), 3, None, temperature=1.0, generator=g, ctx_ids=torch.tensor([prompt]))
    assert torch.allclose(dr.q.sum(-1), torch.ones(1, 2, dtype=dr.q.dtype))
    assert float(dr.q[..., [1, 3]].abs().sum()) == 0.0             # zero outside the subset
    n = 800
    counts = sample_many(t, d, prompt, n)
    assert tv(counts, exact, n) < 0.09


@pytest.mark.parametrize("method", ["dflash", "domino", "eagle"])
def test_frspec_restrict_after_training(target, plain, seqs, trained_eagle, method):
    """FR-Spec applied to an already trained drafter (as FR-Spec itself does): same weights, drafts only from the
    list, ids map back to the vocabulary, the original is untouched, greedy stays lossless."""
    from domino_lab.models.frspec import restrict

    d = trained_eagle if method == "eagle" else Drafter.untrained(target, method, seed=4, block_size=8)
    if method != "eagle":
        brief_train(d, seqs, steps=30)
    rows = [{"input_ids": s.tolist(), "loss_mask": [0] * 4 + [1] * (len(s) - 4)} for s in seqs]
    ids = frequent_tokens(rows, 20, target.vocab_size)
    r = restrict(d, ids)
    assert d.config.frspec_k == 0 and r.config.frspec_k == 20 and r.draft_vocab.tolist() == ids
    assert all(torch.equal(a, b) for (k, a), (_, b) in zip(
        d.state_dict().items(), ((k, v) for k, v in r.state_dict().items() if k != "frspec_ids")))
    for p in PROMPTS[:4]:
        res = speculative_generate(target, r, prompt_ids=p, max_new_tokens=NEW)
        assert all(t in ids for s in res.steps for t in s.draft_tokens)
    assert_lossless(target, plain, r)
    full = restrict(d, list(range(target.vocab_size)))     # K = V: exactly the unrestricted drafts
    for p in PROMPTS[:3]:
        a = speculative_generate(target, d, prompt_ids=p, max_new_tokens=NEW)
        b = speculative_generate(target, full, prompt_ids=p, max_new_tokens=NEW)
        assert [s.draft_tokens for s in a.steps] == [s.draft_tokens for s in b.steps]


def test_full_vocab_option_and_warm_start_from_a_restricted_drafter(target, seqs, tmp_path):
    """A drafter that carries an FR-Spec list (as the shipped ones do) drafts over the whole vocabulary under
    the `full_vocab` inference option, and is a valid warm-start source: the list is not a weight."""
    import argparse

    from domino_lab.models.frspec import restrict
    from domino_lab.models.options import InferenceOptions, add_inference_args
    from domino_lab.training.module import warm_start

    p = argparse.ArgumentParser()
    add_inference_args(p)
    assert InferenceOptions.from_args(p.parse_args(["--full-vocab"])).full_vocab
    assert not InferenceOptions.from_args(p.parse_args([])).full_vocab
    d = Drafter.untrained(target, "domino", seed=4, block_size=8)
    ids = list(range(4, 24))
    r = restrict(d, ids)
    full = restrict(d, ids).set_options(InferenceOptions(full_vocab=True))
    assert r.draft_vocab.tolist() == ids and full.draft_vocab is None
    for p_ in PROMPTS[:3]:
        a = speculative_generate(target, full, prompt_ids=p_, max_new_tokens=NEW)
        b = speculative_generate(target, d, prompt_ids=p_, max_new_tokens=NEW)
        assert [s.draft_tokens for s in a.steps] == [s.draft_tokens for s in b.steps]
    fresh = Drafter.untrained(target, "domino", seed=9, block_size=8)
    assert "frspec_ids" not in warm_start(fresh, r)     # frspec_k 0 here, 20 in the source: the list is skipped
    assert all(torch.equal(v, d.state_dict()[k]) for k, v in fresh.state_dict().items())
    same = Drafter.untrained(target, "domino", seed=9, block_size=8, frspec_k=len(ids))
    assert "frspec_ids" in warm_start(same, r) and same.draft_vocab.tolist() == ids   # a list of this size is kept
