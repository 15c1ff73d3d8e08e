"""The drafter's pieces against the equations of docs/design.md (#backbone, #domino-head)."""
import argparse

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from domino_lab import Drafter, DrafterConfig
from domino_lab.errors import UserError
from domino_lab.models.backbone import block_attention_mask
from domino_lab.models.options import InferenceOptions, add_inference_args
from domino_lab.training.objective import sample_anchors
from core_helpers import tiny_target


def test_block_mask_matches_brute_force():
    anchors = torch.tensor([[2, 5, 9, 0], [0, 3, 4, 7]])
    keep = torch.tensor([[True, True, True, False], [True, True, True, True]])
    S, B = 12, 3
    m = block_attention_mask(anchors, keep, S, B)
    assert m.shape == (2, 1, 4 * B, S + 4 * B)
    for b in range(2):
        for q in range(4 * B):
            blk = q // B
            for kv in range(S + 4 * B):
                if kv < S:
                    want = bool(keep[b, blk]) and kv < int(anchors[b, blk])   # strictly before the anchor
                else:
                    want = (kv - S) // B == blk                               # own block, both directions
                assert bool(m[b, 0, q, kv]) == want, (b, q, kv)


def test_anchor_sampling_only_on_supervised_pairs():
    lm = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1]])
    anchors, keep = sample_anchors(lm, 4, torch.Generator().manual_seed(0))
    for b in range(2):
        kept = anchors[b][keep[b]].tolist()
        assert kept == sorted(kept) and len(set(kept)) == len(kept)
        for a in kept:
            assert lm[b, a] == 1 and lm[b, a + 1] == 1
    assert keep[0].sum() == 3 and keep[1].sum() == 1


def test_kv_injection_shapes(target, monkeypatch):
    d = Drafter.untrained(target, "dflash", block_size=4, num_layers=2)
    seen = []
    attn = d.backbone.layers[1].self_attn
    orig = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((q.shape, k.shape, v.shape))
        return orig(q, k, v, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    feats = torch.randn(1, 7, len(d.config.target_layer_ids) * 32, dtype=torch.float64)
    cache = DynamicCache()
    d.draft(feats, 0, torch.tensor([5]), 7, cache)
    # queries: block only (4 slots, 4 heads); keys/values: 7 context + 4 block positions (2 kv heads)
    assert seen[0] == ((1, 4, 4, 8), (1, 2, 11, 8), (1, 2, 11, 8))
    assert cache.get_seq_length() == 7          # block K/V cropped off, context kept
    assert attn.k_proj.weight.shape == (2 * 8, 32)


def test_training_forward_equals_inference_per_block(target):
    """The masked all-blocks-at-once training forward gives the same logits as drafting each block alone."""
    cases = [(m, s, a, False) for m in ("dflash", "domino") for s in (True, False) for a in (False, True)]
    for method, shift, af, cf in cases + [("domino", True, False, True), ("domino", False, False, True)]:
        d = Drafter.untrained(target, method, seed=3, block_size=4, shift_label=shift, anchor_feature=af,
                              correct_first=cf)
        if d.head is not None:
            with torch.no_grad():
                d.head.w2.weight.normal_(std=0.5)   # a visible correction, unlike the small init
        ids = torch.randint(4, 60, (1, 20), generator=torch.Generator().manual_seed(1))
        feats = target.forward(ids, taps=d.config.target_layer_ids).features
        lm = torch.ones_like(ids)
        anchors = torch.tensor([[3, 8, 11]])
        keep = torch.ones_like(anchors, dtype=torch.bool)
        bb = d.training_blocks(feats, ids, lm, anchors, keep)
        for j, a in enumerate(anchors[0].tolist()):
            dr = d.draft(feats[:, :a], 0, ids[:, a], a, DynamicCache())
            # draft() picks its own tokens; feed the same prefix the teacher-forced path used
            h_tokens = bb.prefix[0, j]
            torch.testing.assert_close(bb.logits_base[0, j].topk(5).values, dr.base_topk[1][0])
            if method == "domino":
                # rollout with argmax tokens: compare where the argmax prefix equals the true prefix
                own = torch.cat([ids[0, a:a + 1], dr.tokens[0, :-1]])
                same = (own == h_tokens).long().cumprod(0)
                for i in range(d.config.num_drafts):
                    if same[i]:
                        torch.testing.assert_close(bb.logits_final[0, j, i].topk(5).values, dr.final_topk[1][0, i])
                # draft 0 is final as it is drafted: corrected exactly when correct_first
                assert torch.equal(bb.logits_final[0, j, 0], bb.logits_base[0, j, 0]) != cf


def test_anchor_feature_reads_the_state_before_the_anchor(target):
    """anchor_feature: the block's inputs carry the context state at anchor-1, whether the context arrives at once
    or step by step through the draft cache (as in decoding), and it changes the drafts (the projection is live)."""
    ids = torch.randint(4, 60, (1, 20), generator=torch.Generator().manual_seed(2))
    d = Drafter.untrained(target, "dflash", seed=4, block_size=4, anchor_feature=True)
    feats = target.forward(ids, taps=d.config.target_layer_ids).features
    a = 12
    fresh = d.draft(feats[:, :a], 0, ids[:, a], a, DynamicCache())
    cache = DynamicCache()
    d.draft(feats[:, :7], 0, ids[:, 7], 7, cache)                      # an earlier round filled the cache
    stepped = d.draft(feats[:, 7:a], 7, ids[:, a], a, cache)
    torch.testing.assert_close(stepped.base_topk[1], fresh.base_topk[1], rtol=1e-5, atol=1e-5)
    plain = Drafter.untrained(target, "dflash", seed=4, block_size=4)
    plain.load_state_dict({k: v for k, v in d.state_dict().items() if "anchor_proj" not in k})
    other = plain.draft(feats[:, :a], 0, ids[:, a], a, DynamicCache())
    assert not torch.allclose(other.base_topk[1], fresh.base_topk[1])
    # which state: zeroing anchor-1's feature changes the block, zeroing an older one only through attention
    bp = torch.arange(a, a + 4)[None]
    ctx = d.backbone.hidden_norm(d.backbone.fc(feats[:, :a]))
    got = d.backbone.anchor_context(ctx, torch.arange(a)[None], bp)
    torch.testing.assert_close(got, ctx[:, a - 1:a].expand(-1, 4, -1))


def test_gru_zero_state_per_block(target):
    d = Drafter.untrained(target, "domino", block_size=4)
    emb = target.embed_tokens(torch.tensor([[5, 6, 7, 8], [9, 9, 5, 6]]))
    both = d.head.prefix_states(emb)
    alone = d.head.prefix_states(emb[1:])
    torch.testing.assert_close(both[1:], alone)     # block 2 does not inherit block 1's state
    h0 = d.head.step(emb[0, 0][None], None)
    torch.testing.assert_close(h0, both[0, 0][None])   # None == explicit zero state


def test_slot0_uncorrected_and_correction_is_lowrank(target):
    d = Drafter.untrained(target, "domino", block_size=4)
    with torch.no_grad():
        d.head.w2.weight.normal_(std=1.0)
    h = torch.randn(3, 4, 32, dtype=torch.float64)
    prefix = torch.randint(4, 60, (3, 4))
    base = d.lm_head(h)
    final = d.head.corrected_logits(h, base, d.embed(prefix))
    torch.testing.assert_close(final[:, 0], base[:, 0])
    s = d.head.prefix_states(target.embed_tokens(prefix))
    want = d.head.w2(F.silu(d.head.w1(torch.cat([h, s], -1))))
    torch.testing.assert_close(final[:, 1:] - base[:, 1:], want[:, 1:])
    with torch.no_grad():
        d.head.w2.weight.zero_()
    final = d.head.corrected_logits(h, base, d.embed(prefix))
    torch.testing.assert_close(final, base)          # no other path from the head into the logits
    d.head_enabled = False
    assert not d.uses_head


def test_dflash_has_no_head_and_param_counts(target):
    dd = Drafter.untrained(target, "dflash")
    dm = Drafter.untrained(target, "domino")
    assert dd.head is None and dd.param_counts()["head"] == 0
    pc = dm.param_counts()
    cfg = dm.config
    gru = 3 * cfg.gru_hidden * (cfg.hidden_size + cfg.gru_hidden)
    assert pc["head"] == gru + (cfg.hidden_size + cfg.gru_hidden) * cfg.rank + cfg.rank * cfg.vocab_size
    assert pc["backbone"] == dd.param_counts()["backbone"]


def test_save_load_roundtrip_and_mismatch(tmp_path, target):
    d = Drafter.untrained(target, "domino", seed=5, block_size=4, rank=8, gru_hidden=16)
    d.save_pretrained(tmp_path / "dr")
    assert sorted(p.name for p in (tmp_path / "dr").iterdir()) == ["config.json", "model.safetensors"]
    d2 = Drafter.from_pretrained(tmp_path / "dr", target)
    for (k, v), (k2, v2) in zip(d.state_dict().items(), d2.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    other = tiny_target(hidden=48)
    with pytest.raises(UserError, match="does not fit"):
        Drafter.from_pretrained(tmp_path / "dr", other)
    with pytest.raises(UserError, match="not a drafter directory"):
        Drafter.from_pretrained(tmp_path / "nothing", target)


def test_save_pretrained_keeps_the_old_drafter_if_the_swap_fails(tmp_path, target, monkeypatch):
    """best/ and final/ are replaced whole: a failure while the new directory is moved in leaves the old one."""
    import os

    from domino_lab.models import drafter as drafter_mod

    old = Drafter.untrained(target, "domino", seed=1, block_size=4, rank=8, gru_hidden=16)
    old.save_pretrained(tmp_path / "best")
    before = {p.name: p.read_bytes() for p in (tmp_path / "best").iterdir()}
    real = os.replace

    def crash_on_swap(src, dst):
        if str(dst) == str(tmp_path / "best") and ".best." in str(src) and ".old." not in str(src):
            raise OSError(5, "Input/output error")
        return real(src, dst)

    monkeypatch.setattr(drafter_mod.os, "replace", crash_on_swap)
    new = Drafter.untrained(target, "domino", seed=2, block_size=4, rank=8, gru_hidden=16)
    with pytest.raises(OSError):
        new.save_pretrained(tmp_path / "best")
    assert {p.name: p.read_bytes() for p in (tmp_path / "best").iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["best"]          # no temporary directory left behind
    monkeypatch.setattr(drafter_mod.os, "replace", real)
    new.save_pretrained(tmp_path / "best")
    assert [p.name for p in tmp_path.iterdir()] == ["best"]
    assert torch.equal(Drafter.from_pretrained(tmp_path / "best", target).state_dict()["head.w2.weight"],
                       new.state_dict()["head.w2.weight"])


def test_damaged_or_mismatched_checkpoint_is_one_clear_error(tmp_path, target):
    import json

    d = Drafter.untrained(target, "domino", block_size=4, rank=8, gru_hidden=16)
    d.save_pretrained(tmp_path / "dr")
    weights, cfg = tmp_path / "dr" / "model.safetensors", tmp_path / "dr" / "config.json"
    good, good_cfg = weights.read_bytes(), cfg.read_text()
    for cut in (len(good) - 10, 100, 4):        # cut in the tensor data, in the header, in the header's length
        weights.write_bytes(good[:cut])
        with pytest.raises(UserError, match="model.safetensors"):
            Drafter.from_pretrained(tmp_path / "dr", target)
    weights.write_bytes(good)
    for key, value, names in (("rank", 16, "head"), ("num_layers", 2, "layers.1"), ("intermediate_size", 48, "mlp")):
        cfg.write_text(json.dumps(json.loads(good_cfg) | {key: value}))
        with pytest.raises(UserError, match=f"do not match config.json.*{names}"):
            Drafter.from_pretrained(tmp_path / "dr", target)
    cfg.write_text(good_cfg)
    Drafter.from_pretrained(tmp_path / "dr", target)


def test_config_validation():
    with pytest.raises(UserError, match="unknown drafter method"):
        DrafterConfig(method="medusa")
    with pytest.raises(UserError, match="unknown key"):
        DrafterConfig.from_dict({"method": "domino", "bogus": 1})


@pytest.mark.parametrize("field,bad,match,flag,value,default", [
    ("lookup", [-1, 17], "lookup must be from 0 to 16", "--lookup", "3", 0),
    ("draft_cutoff", [1.0], "draft cutoff", "--draft-cutoff", "0.2", 0.0),
    ("tree_min_prob", [-0.1, 1.0], "tree min prob", "--tree-min-prob", "0.05", 0.0),
])
def test_inference_options_are_checked_and_parsed(field, bad, match, flag, value, default):
    """Each option refuses an out-of-range value with one clear error and parses from its CLI flag."""
    for b in bad:
        with pytest.raises(UserError, match=match):
            InferenceOptions(**{field: b})
    p = argparse.ArgumentParser()
    add_inference_args(p)
    assert getattr(InferenceOptions.from_args(p.parse_args([flag, value])), field) == type(default)(value)
    assert getattr(InferenceOptions.from_args(p.parse_args([])), field) == default
