"""The block drafters' compiled backbone (InferenceOptions.backbone_impl = "compiled"): `Backbone.infer` computes what
the cached eager pass computes, and decoding through its compiled graph stays lossless and drafts what eager drafts."""
from __future__ import annotations

import pytest
import torch

from domino_lab import Target
from domino_lab.data.eval_sets import load_eval_set
from domino_lab.decoding import speculative_generate
from domino_lab.decoding.kv_cache import new_cache
from domino_lab.errors import UserError
from domino_lab.models import InferenceOptions, compiled_pass, load_drafter


@pytest.fixture(scope="module")
def target():
    return Target.from_pretrained("default", dtype="float32")


@pytest.mark.parametrize("spec", ["default", "default-dflash"])
def test_infer_equals_the_cached_forward(target, spec):
    """Three rounds of new context and a block: the written-out pass over the cache's buffers gives the eager
    backbone's states, the keys and values it writes into the buffers are exactly what the eager pass leaves in the
    cache, and it writes nothing past them."""
    d = load_drafter(spec, target)
    cfg, bb = d.config, d.backbone
    g = torch.Generator().manual_seed(0)
    eager = new_cache()
    bufs = [tuple(torch.full((1, cfg.num_key_value_heads, 16, cfg.head_dim), 7.0) for _ in range(2))
            for _ in bb.layers]
    start = 0
    with torch.no_grad():
        for new in (5, 1, 3):
            emb = torch.randn(1, cfg.block_size, cfg.hidden_size, generator=g)
            feats = torch.randn(1, new, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g)
            ctx_pos = torch.arange(start, start + new)[None]
            blk_pos = torch.arange(start + new, start + new + cfg.block_size)[None]
            want = bb(emb, blk_pos, feats, ctx_pos, cache=eager)
            eager.crop(-cfg.block_size)
            got = bb.infer(emb, feats, torch.cat([ctx_pos, blk_pos], 1), bufs, start)
            assert torch.allclose(got, want, atol=1e-5)
            start += new
            for i, (k, v) in enumerate(bufs):
                assert torch.allclose(k[:, :, :start], eager.layers[i].keys, atol=1e-5)
                assert torch.allclose(v[:, :, :start], eager.layers[i].values, atol=1e-5)
                assert (k[:, :, start:] == 7).all() and (v[:, :, start:] == 7).all()


@pytest.mark.parametrize("spec", ["default", "default-dflash"])
def test_compiled_backbone_decodes_losslessly_and_drafts_what_eager_drafts(target, spec):
    """Chains and trees through the compiled pass (embeddings, copy input, backbone and draft LM head as one graph)
    decode what plain decoding does, step by step as the eager drafter does, with the same base top-k in the records;
    copy candidates outside the FR-Spec list (names in the prompt) extend the logits after the graph."""
    # (humaneval's 11th prompt drafts from copy candidates outside the FR-Spec list)
    prompts = [load_eval_set("math", limit=1)[0]["prompt"], load_eval_set("humaneval", limit=11)[10]["prompt"]]
    eager = load_drafter(spec, target)
    compiled = load_drafter(spec, target, options=InferenceOptions(backbone_impl="compiled"))
    extended = []
    unlisted = compiled.unlisted
    compiled.unlisted = lambda ids: extended.append(x := unlisted(ids)) or x
    for p in prompts:
        plain = speculative_generate(target, None, prompt=p, max_new_tokens=40).token_ids
        for nodes in (0, 16):
            a = speculative_generate(target, eager, prompt=p, max_new_tokens=40, tree_nodes=nodes, topk=5)
            b = speculative_generate(target, compiled, prompt=p, max_new_tokens=40, tree_nodes=nodes, topk=5)
            assert a.token_ids == b.token_ids == plain
            # the same drafts, step by step (fusion reorders float sums, which moves no argmax here)
            assert [s.accepted for s in a.steps] == [s.accepted for s in b.steps]
            assert [s.base_topk_ids for s in a.steps] == [s.base_topk_ids for s in b.steps]
            for x, y in zip(a.steps, b.steps):
                assert (x.base_topk_logits is None) == (y.base_topk_logits is None)
                if x.base_topk_logits is not None:
                    assert torch.allclose(torch.tensor(x.base_topk_logits), torch.tensor(y.base_topk_logits),
                                          atol=1e-3)
    assert any(x is not None and x.numel() for x in extended)        # the extension after the graph was taken
    assert "_draft_pass" in compiled._compiled and getattr(eager, "_compiled", None) is None
    # every call ran a graph compiled ahead, its guards held at the first call: nothing went the guarded way
    passes = compiled._compiled["_draft_pass"]
    mine = [ok for sig, ok in passes.checked.items() if sig[0] == id(compiled)]
    assert mine and all(mine) and passes._dynamo is None


def test_calls_the_graphs_do_not_cover_go_through_torch_compile(target):
    """A one-token prompt (an empty cache with a context of one position, then one cached position: shape classes
    without a graph of their own) and an int32 anchor (an input dtype the graphs were not compiled for: its first
    guard check fails) go through ordinary torch.compile, and draft as the eager drafter does."""
    eager = load_drafter("default", target)
    compiled = load_drafter("default", target, options=InferenceOptions(backbone_impl="compiled"))
    for prompt in ("def", "def f(x):\n"):
        a, b = (speculative_generate(target, d, prompt=prompt, max_new_tokens=24) for d in (eager, compiled))
        plain = speculative_generate(target, None, prompt=prompt, max_new_tokens=24)
        assert a.token_ids == b.token_ids == plain.token_ids
        assert [s.accepted for s in a.steps] == [s.accepted for s in b.steps]
        passes = compiled._compiled["_draft_pass"]
        if prompt == "def":
            assert len(target.encode(prompt)) == 1 and passes._dynamo is not None   # its classes had no graph
            assert all(passes.checked.values())
    cfg, g = compiled.config, torch.Generator().manual_seed(0)
    feats = torch.randn(1, 6, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g)
    drafts = []
    with torch.no_grad():
        for d in (eager, compiled):
            cache = new_cache()
            d.draft(feats[:, :4], 0, torch.tensor([5]), 4, cache)
            drafts.append(d.draft(feats[:, 4:], 4, torch.tensor([7], dtype=torch.int32), 6, cache).tokens)
    assert torch.equal(*drafts)
    assert False in passes.checked.values() and True in passes.checked.values()     # int32 failed its check


def test_the_compiled_pass_fills_growing_and_other_cache_layers(target):
    """The compiled pass writes the new context's keys and values into a growing layer's buffers itself (growing
    them when full) and hands them to any other layer (Hugging Face's concatenating one) after the call: either way
    the cache ends up holding what the eager drafter's holds, and the drafts are the eager drafter's."""
    from transformers import DynamicCache

    eager = load_drafter("default", target)
    compiled = load_drafter("default", target, options=InferenceOptions(backbone_impl="compiled"))
    cfg, g = compiled.config, torch.Generator().manual_seed(1)
    feats = torch.randn(1, 90, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g)
    # (with a capacity of 81 the first step fills the buffer and the next one reallocates it)
    steps = [(0, 80), (80, 83), (83, 84), (84, 90)]
    with torch.no_grad():
        want_cache = new_cache()
        want = [eager.draft(feats[:, a:b], a, torch.tensor([b % 50 + 3]), b, want_cache).tokens for a, b in steps]
        for make in (new_cache, lambda: new_cache(capacity=81), DynamicCache):
            cache = make()
            got = [compiled.draft(feats[:, a:b], a, torch.tensor([b % 50 + 3]), b, cache).tokens for a, b in steps]
            assert all(torch.equal(x, y) for x, y in zip(got, want))
            assert len(cache.layers) == cfg.num_layers
            for mine, theirs in zip(cache.layers, want_cache.layers):
                assert mine.keys.shape == theirs.keys.shape == (1, cfg.num_key_value_heads, 90, cfg.head_dim)
                assert torch.allclose(mine.keys, theirs.keys, atol=1e-5)
                assert torch.allclose(mine.values, theirs.values, atol=1e-5)


def test_backbone_impl_is_checked():
    with pytest.raises(UserError, match="unknown backbone implementation 'jit'"):
        InferenceOptions(backbone_impl="jit")


def test_gumbel_noise_and_the_full_vocabulary_go_after_the_graph(target):
    """Gumbel-coupled sampling adds its noise to the graph's logits (and ranks them again), and a drafter drafting
    over the whole vocabulary passes the full LM head through it: both sample the text the eager drafter does."""
    p = load_eval_set("humaneval", limit=1)[0]["prompt"]
    for opts, kw in (({}, dict(temperature=1.0, sampler="gumbel", seed=3)), (dict(full_vocab=True), {})):
        a, b = (speculative_generate(target, load_drafter("default", target, options=InferenceOptions(
            backbone_impl=impl, **opts)), prompt=p, max_new_tokens=30, **kw) for impl in ("eager", "compiled"))
        assert a.token_ids == b.token_ids and [s.accepted for s in a.steps] == [s.accepted for s in b.steps]


def test_every_graph_is_compiled_at_the_first_draft(target):
    """An empty cache, a context of one position and the general case each take a graph; all three are compiled at
    the first draft, so no later step (a step that accepted nothing, a new prompt) stalls to compile, and the
    cache's layout (views of a buffer) does not multiply them."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()           # graphs compiled by earlier tests would serve this drafter too
    compiled_pass.clear()
    d = load_drafter("default", target, options=InferenceOptions(backbone_impl="compiled"))
    rows = load_eval_set("humaneval", limit=3)
    before = counters["stats"]["unique_graphs"]
    first = speculative_generate(target, d, prompt="def f(x):\n", max_new_tokens=6)       # one draft: compiles
    graphs = counters["stats"]["unique_graphs"]
    assert first.steps and graphs == before + 3
    steps = [s for r in rows for s in speculative_generate(target, d, prompt=r["prompt"], max_new_tokens=60).steps]
    assert any(s.accepted == 0 for s in steps[1:])          # a later step's draft took a 1-position context
    assert counters["stats"]["unique_graphs"] == graphs


def test_drafters_of_one_structure_share_graphs_and_of_another_get_their_own(target):
    """The graphs compiled ahead read a drafter's weights from the drafter, so two drafters of one structure share
    them (a bench's second `default` compiles nothing) while a drafter without the copy input gets graphs of its own;
    dynamo's recompile limit (graphs per function across all drafters) does not apply to them, and each drafts as its
    eager self does."""
    from torch._dynamo.utils import counters

    p = load_eval_set("humaneval", limit=1)[0]["prompt"]
    with torch._dynamo.config.patch(recompile_limit=1):
        passes = []
        for spec in ("default", "default", "default-nocopy"):
            d = load_drafter(spec, target, options=InferenceOptions(backbone_impl="compiled"))
            before = counters["stats"]["unique_graphs"]
            got = speculative_generate(target, d, prompt=p, max_new_tokens=40)
            if passes and spec == "default":
                assert counters["stats"]["unique_graphs"] == before        # the first default's graphs served it
            want = speculative_generate(target, load_drafter(spec, target), prompt=p, max_new_tokens=40)
            assert got.token_ids == want.token_ids
            assert [s.accepted for s in got.steps] == [s.accepted for s in want.steps]
            passes.append(d._compiled["_draft_pass"])
    assert passes[0] is passes[1] and passes[2] is not passes[0] and len(passes[2].graphs) == 3
