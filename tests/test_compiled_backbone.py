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
from domino_lab.models import InferenceOptions, load_drafter


@pytest.fixture(scope="module")
def target():
    return Target.from_pretrained("default", dtype="float32")


@pytest.mark.parametrize("spec", ["default", "default-dflash"])
def test_infer_equals_the_cached_forward(target, spec):
    """Three rounds of new context and a block: the written-out pass with the cache's tensors gives the eager
    backbone's states, and the keys and values it returns are exactly what the eager pass leaves in the cache."""
    d = load_drafter(spec, target)
    cfg, bb = d.config, d.backbone
    g = torch.Generator().manual_seed(0)
    eager, mine = new_cache(), []
    start = 0
    with torch.no_grad():
        for new in (5, 1, 3):
            emb = torch.randn(1, cfg.block_size, cfg.hidden_size, generator=g)
            feats = torch.randn(1, new, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g)
            ctx_pos = torch.arange(start, start + new)[None]
            blk_pos = torch.arange(start + new, start + new + cfg.block_size)[None]
            want = bb(emb, blk_pos, feats, ctx_pos, cache=eager)
            eager.crop(-cfg.block_size)
            empty = torch.zeros(1, cfg.num_key_value_heads, 0, cfg.head_dim)
            past = [(torch.cat([k for k, _ in layer] or [empty], 2), torch.cat([v for _, v in layer] or [empty], 2))
                    for layer in (mine or [[] for _ in bb.layers])]
            got, kv = bb.infer(emb, feats, torch.cat([ctx_pos, blk_pos], 1), past)
            mine = [layer + [pair] for layer, pair in zip(mine or [[] for _ in bb.layers], kv)]
            assert torch.allclose(got, want, atol=1e-5)
            for i, layer in enumerate(mine):
                assert torch.allclose(torch.cat([k for k, _ in layer], 2), eager.layers[i].keys, atol=1e-5)
                assert torch.allclose(torch.cat([v for _, v in layer], 2), eager.layers[i].values, atol=1e-5)
            start += new


def test_compiled_backbone_decodes_losslessly_and_drafts_what_eager_drafts(target):
    prompts = [load_eval_set(s, limit=1)[0]["prompt"] for s in ("math", "humaneval")]
    eager = load_drafter("default", target)
    compiled = load_drafter("default", target, options=InferenceOptions(backbone_impl="compiled"))
    for p in prompts:
        plain = speculative_generate(target, None, prompt=p, max_new_tokens=40).token_ids
        a = speculative_generate(target, eager, prompt=p, max_new_tokens=40)
        b = speculative_generate(target, compiled, prompt=p, max_new_tokens=40)
        assert a.token_ids == b.token_ids == plain
        # the same drafts, step by step (fusion reorders float sums, which moves no argmax here)
        assert [s.accepted for s in a.steps] == [s.accepted for s in b.steps]
    assert getattr(compiled, "_infer", None) is not None and getattr(eager, "_infer", None) is None


def test_backbone_impl_is_checked():
    with pytest.raises(UserError, match="unknown backbone implementation 'jit'"):
        InferenceOptions(backbone_impl="jit")
