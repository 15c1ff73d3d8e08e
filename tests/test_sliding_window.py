"""Targets with sliding-window attention (Mistral-style windows, Gemma 3's alternating local layers) and with
linear-attention layers: every decode equals Hugging Face's own greedy decoding (past the window), and what cannot be
done exactly is one clear error before any decoding."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

from core_helpers import brief_train, greedy_sequences
from domino_lab import Drafter, Target
from domino_lab.decoding import batched
from domino_lab.decoding.batched import batched_generate
from domino_lab.decoding.engine import speculative_generate
from domino_lab.decoding import engine, kv_cache
from domino_lab.decoding.kv_cache import GrowingLayer, WindowLayer, has_sliding_window, new_cache
from domino_lab.errors import UserError

V, WINDOW, NEW = 64, 6, 40


def _target(kind: str) -> Target:
    torch.manual_seed(0)
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=512, eos_token_id=3,
                  sliding_window=WINDOW, tie_word_embeddings=False)
    if kind == "mistral":                   # every layer slides
        model = MistralForCausalLM(MistralConfig(**common))
    elif kind == "gemma3":                  # local and global layers alternate
        model = Gemma3ForCausalLM(Gemma3TextConfig(**common, layer_types=["sliding_attention", "full_attention"] * 2))
    else:                                   # Qwen2's switch: layers from max_window_layers on slide
        model = Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=True, max_window_layers=2))
    return Target(model.to(torch.float64), None, mask_token_id=V - 1, taps=[1, 2])


@pytest.fixture(scope="module", params=["mistral", "gemma3", "qwen2"])
def setup(request):
    target = _target(request.param)
    seqs = greedy_sequences(target, 32, 30)
    d = Drafter.untrained(target, "domino", block_size=8)
    brief_train(d, seqs, steps=40)               # drafts that are often accepted: multi-token steps past the window
    prompts = [seqs[i, : 4 + 4 * i].tolist() for i in range(4)] + [[7, 9, 11]]
    return target, d, prompts


def _hf_greedy(target, prompt):
    ids = torch.tensor([prompt])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                                eos_token_id=3, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_the_window_matters_for_these_targets(setup):
    # without this the equality below would prove nothing about the window
    target, _, prompts = setup
    assert has_sliding_window(target.model.config)
    windowed = [_hf_greedy(target, p) for p in prompts]
    target.model.config.sliding_window = 10_000
    try:
        unwindowed = [_hf_greedy(target, p) for p in prompts]
    finally:
        target.model.config.sliding_window = WINDOW
    assert windowed != unwindowed


def test_decoding_past_the_window_equals_hugging_face_greedy(setup):
    target, d, prompts = setup
    assert all(type(layer) is GrowingLayer for layer in new_cache(target.model.config).layers)
    accepted = 0
    for p in prompts:
        ref = _hf_greedy(target, p)
        assert speculative_generate(target, None, prompt_ids=p, max_new_tokens=NEW).token_ids == ref
        for opts in ({}, {"lookup": 2}, {"adaptive_drafts": True}, {"head_enabled": False}, {"tree": 16},
                     {"tree": 16, "head_enabled": False}):
            saved, head = d.options, d.head_enabled
            d.options = dataclasses.replace(saved, **{k: opts[k] for k in ("lookup", "adaptive_drafts") if k in opts})
            d.head_enabled = opts.get("head_enabled", head)
            try:
                res = speculative_generate(target, d, prompt_ids=p, max_new_tokens=NEW, tree_nodes=opts.get("tree", 0))
            finally:
                d.options, d.head_enabled = saved, head
            assert res.token_ids == ref, (p, opts)
            accepted += sum(s.accepted for s in res.steps)
    assert accepted > 50                     # drafts were accepted, so caches were cut back past rejected ones


def test_a_decode_keeps_only_the_window(setup, monkeypatch):
    # a chain's and a tree's sliding layers hold the window (and the last verify's tokens), not the whole context
    target, d, prompts = setup
    made = []

    def spy(*args, **kwargs):
        made.append(new_cache(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(engine, "new_cache", spy)
    for nodes in (0, 16):
        res = speculative_generate(target, d, prompt_ids=prompts[3], max_new_tokens=NEW, tree_nodes=nodes)
        assert res.token_ids == _hf_greedy(target, prompts[3])
        sliding = [layer for layer in made[-2].layers if layer.is_sliding]
        total = len(prompts[3]) + len(res.token_ids) - 1        # (the last token is never fed back)
        assert made[-2].get_seq_length() == total > 3 * WINDOW
        assert sliding and all(type(layer) is WindowLayer for layer in sliding)
        assert all(layer.offset > 0 and layer.keys.shape[-2] <= WINDOW + 8 for layer in sliding)
        assert all(type(layer) is GrowingLayer for layer in made[-2].layers if not layer.is_sliding)


def test_batches_and_queues_equal_each_prompt_alone(setup, monkeypatch):
    # rows keep rejected drafts as holes, so their columns run ahead of their positions: the windows are counted in
    # positions by the verify's own mask, and the sliding layers drop the columns no row's window reaches any more
    target, d, prompts = setup
    refs = [speculative_generate(target, None, prompt_ids=p, max_new_tokens=NEW).token_ids for p in prompts]
    held = []

    def spy(cache, valid, next_pos, least=None):
        kv_cache.drop_outside_windows(cache, valid, next_pos, least)
        sliding = [layer for layer in cache.layers if type(layer) is kv_cache.RowsWindowLayer]
        assert sliding and all(type(layer) is GrowingLayer for layer in cache.layers if layer not in sliding)
        held.append((max(layer.held() for layer in sliding), valid.shape[1], min(layer.offset for layer in sliding)))

    monkeypatch.setattr(batched, "drop_outside_windows", spy)
    for drafter, drafts, slots in ((None, "all", 2), (d, "all", None), (d, "adaptive", 3), (d, 3, None)):
        held.clear()
        out = batched_generate(target, drafter, prompts, max_new_tokens=NEW, drafts=drafts, slots=slots)
        assert out.token_ids == refs, (drafter is not None, drafts, slots)
        # the window (W - 1 positions, more columns where rows kept holes) plus at most one drop's worth of columns
        assert max(o for _, _, o in held) > 0 and max(h for h, _, _ in held) < max(n for _, n, _ in held)


def test_linear_attention_targets_roll_back_chains_and_batch_rows_and_refuse_trees():
    # Qwen3-Next-style: gated delta-rule layers (a recurrent state per sequence) and one full-attention layer. A chain
    # undoes a verify's rejected drafts from the recorded states; a batch takes each row's own state from them
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3NextConfig(vocab_size=V, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, intermediate_size=64, mlp_only_layers=[0, 1, 2, 3],
                          linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
                          linear_value_head_dim=8, max_position_embeddings=512, eos_token_id=3)
    model = Qwen3NextForCausalLM(cfg)
    for layer in model.model.layers:
        if hasattr(layer, "linear_attn"):
            # slow decay: the recurrent state carries far enough back that a wrong one changes the text (with the
            # random init's fast decay, a row given another row's state decoded the same tokens)
            layer.linear_attn.A_log.data.fill_(-4.0)
    target = Target(model.to(torch.float64), None, mask_token_id=V - 1, taps=[1, 2])
    seqs = greedy_sequences(target, 32, 30)
    d = Drafter.untrained(target, "domino", block_size=8)
    brief_train(d, seqs, steps=40)
    accepted = rejected = 0
    prompts = [seqs[i, : 4 + 4 * i].tolist() for i in range(4)] + [[7, 9, 11]]
    refs = [_hf_greedy(target, p) for p in prompts]
    for p, ref in zip(prompts, refs):
        for opts in ({}, {"lookup": 2}):
            saved = d.options
            d.options = dataclasses.replace(saved, **opts)
            try:
                res = speculative_generate(target, d, prompt_ids=p, max_new_tokens=NEW)
            finally:
                d.options = saved
            assert res.token_ids == ref, (p, opts)
            accepted += sum(s.accepted for s in res.steps)
            rejected += sum(s.accepted < len(s.draft_tokens) for s in res.steps)
    assert accepted > 50 and rejected > 10          # both kinds of step: states kept and states rolled back
    for drafter, drafts, slots in ((None, "all", 2), (d, "all", None), (d, "adaptive", 3), (d, 3, 2)):
        out = batched_generate(target, drafter, prompts, max_new_tokens=NEW, drafts=drafts, slots=slots)
        assert out.token_ids == refs, (drafter is not None, drafts, slots)
    with pytest.raises(UserError, match="LinearAttentionLayer layers .*chain verification"):
        speculative_generate(target, d, prompt_ids=[5, 6, 7], max_new_tokens=8, tree_nodes=8)
    # what measures a decode's forwards cuts its cache back the same way (the thread choice for a small batched
    # target, the sweep's step costs)
    from domino_lab.experiments.timing import step_costs
    from domino_lab.target import measure_threads

    assert set(measure_threads(target, (1,), rows=2, reps=1, blocks=1)) == {1}
    assert step_costs(target, d, ctx=16, reps=1, rounds=1)["verify_ms"] > 0


@pytest.mark.parametrize("family", ["bamba", "nemotron_h", "falcon_h1", "mamba"])
def test_mamba_hybrids_decode_exactly_in_chains_and_batches(family):
    # Mamba-2 layers (Bamba, which counts positions from 0 in a forward not given them), Nemotron-H, whose MLP-only
    # layers have no cache at all (a placeholder layer), Falcon-H1, whose layers hold K/V and states in one, and
    # Mamba alone (no attention: it applies a 2D mask to its inputs untrimmed, so its verifies get none)
    import transformers as hf

    torch.manual_seed(0)
    common = dict(vocab_size=V, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                  max_position_embeddings=512, eos_token_id=3, pad_token_id=0)
    if family == "bamba":
        model = hf.BambaForCausalLM(hf.BambaConfig(**common, num_hidden_layers=4, attn_layer_indices=[2],
                                                   mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
                                                   mamba_d_state=8, mamba_chunk_size=16))
    elif family == "mamba":
        model = hf.MambaForCausalLM(hf.MambaConfig(vocab_size=V, hidden_size=32, state_size=8, num_hidden_layers=4,
                                                   intermediate_size=64, eos_token_id=3, pad_token_id=0))
        with torch.no_grad():                       # weights large enough that a wrong state changes the text
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0, 0.3)
    elif family == "falcon_h1":
        model = hf.FalconH1ForCausalLM(hf.FalconH1Config(**common, num_hidden_layers=4, head_dim=8, mamba_n_heads=4,
                                                         mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8,
                                                         mamba_chunk_size=16, mamba_d_ssm=64))
    else:
        model = hf.NemotronHForCausalLM(hf.NemotronHConfig(**common, layers_block_type=["mamba", "attention", "mlp",
                                                                                        "mamba"], head_dim=8,
                                                           mamba_num_heads=4, mamba_head_dim=16, n_groups=1,
                                                           ssm_state_size=8))
    target = Target(model.to(torch.float64), None, mask_token_id=V - 1, taps=[1, 2])
    seqs = greedy_sequences(target, 32, 30)
    d = Drafter.untrained(target, "domino", block_size=4)
    brief_train(d, seqs, steps=40)               # accepted drafts: rows cut back by different amounts
    prompts = [seqs[i, : 3 + 3 * i].tolist() for i in range(5)]
    refs = [_hf_greedy(target, p) for p in prompts]
    assert [speculative_generate(target, d, prompt_ids=p, max_new_tokens=NEW).token_ids for p in prompts] == refs
    for drafter, slots in ((None, None), (d, None), (d, 2)):
        assert batched_generate(target, drafter, prompts, max_new_tokens=NEW, slots=slots).token_ids == refs


def test_a_target_whose_layers_keep_no_state_per_token_is_refused_up_front():
    # Zamba's Mamba layers update their state in place in a one-token forward and keep one state at most in a longer
    # one, so rejected drafts cannot be undone from what they record
    import transformers as hf

    torch.manual_seed(0)
    cfg = hf.ZambaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
                         num_key_value_heads=4, attention_head_dim=16, n_mamba_heads=2, mamba_d_state=8,
                         mamba_dt_rank=4, attn_layer_period=3, attn_layer_offset=2, max_position_embeddings=512,
                         eos_token_id=3, pad_token_id=0)
    target = Target(hf.ZambaForCausalLM(cfg).to(torch.float64), None, mask_token_id=V - 1, taps=[1, 2])
    d = Drafter.untrained(target, "domino", block_size=4)
    for decode in (lambda: batched_generate(target, None, [[5, 6, 7], [8, 9]], max_new_tokens=6),
                   lambda: speculative_generate(target, d, prompt_ids=[5, 6, 7], max_new_tokens=6)):
        with pytest.raises(UserError, match=r"keep their state after each token .*\(zamba\)"):
            decode()
    assert len(speculative_generate(target, None, prompt_ids=[5, 6, 7], max_new_tokens=6).token_ids) == 6


@pytest.mark.parametrize("family", ["minimax", "xlstm"])
def test_a_target_that_refuses_any_cache_but_its_own_is_refused_in_one_line(family):
    # MiniMax and xLSTM keep their decoding state in cache classes of their own and refuse any other (a ValueError
    # and an AttributeError from inside Hugging Face's forward before this check)
    import transformers as hf

    torch.manual_seed(0)
    if family == "minimax":
        model = hf.MiniMaxForCausalLM(hf.MiniMaxConfig(
            vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1, block_size=16,
            layer_types=["linear_attention", "full_attention"], max_position_embeddings=512))
    else:
        model = hf.xLSTMForCausalLM(hf.xLSTMConfig(vocab_size=V, hidden_size=32, embedding_dim=32, num_hidden_layers=2,
                                                   num_heads=2, mode="inference"))
    target = Target(model, None, mask_token_id=V - 1, taps=[0])
    assert target.own_cache is not None
    d = Drafter.untrained(target, "domino", block_size=4)
    for decode in (lambda: speculative_generate(target, None, prompt_ids=[5, 6, 7], max_new_tokens=4),
                   lambda: speculative_generate(target, d, prompt_ids=[5, 6, 7], max_new_tokens=4),
                   lambda: batched_generate(target, d, [[5, 6, 7], [8, 9]], max_new_tokens=4)):
        with pytest.raises(UserError, match=rf"\({family}\) keeps its decoding state in a cache class of its own"):
            decode()
    # every target of the other families accepts the decoders' cache
    assert Target(Qwen2ForCausalLM(Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)),
                  None, mask_token_id=V - 1, taps=[0]).own_cache is None
