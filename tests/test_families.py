"""Other Hugging Face model families as targets: rotary, learned (GPT-2) and offset (OPT) positions, partial rotary
(GPT-NeoX), fused projections (Phi-3). A briefly trained drafter per target; chain, tree and batched decoding must
each equal the target's own greedy decoding."""
from __future__ import annotations

import pytest
import torch
import transformers as hf

from core_helpers import brief_train, greedy_sequences
from domino_lab import Drafter, Target
from domino_lab.decoding.batched import batched_generate
from domino_lab.decoding.engine import speculative_generate

V, NEW = 64, 32
SHAPE = dict(vocab_size=V, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=256,
             eos_token_id=3, tie_word_embeddings=False)
FAMILIES = {
    "llama": (hf.LlamaConfig, hf.LlamaForCausalLM, dict(SHAPE, intermediate_size=64, num_key_value_heads=2)),
    "gpt2": (hf.GPT2Config, hf.GPT2LMHeadModel, dict(vocab_size=V, n_embd=32, n_layer=4, n_head=4, n_positions=256,
                                                     eos_token_id=3, bos_token_id=3, tie_word_embeddings=False)),
    "opt": (hf.OPTConfig, hf.OPTForCausalLM, dict(SHAPE, ffn_dim=64, word_embed_proj_dim=32)),
    "gpt_neox": (hf.GPTNeoXConfig, hf.GPTNeoXForCausalLM, dict(SHAPE, intermediate_size=64)),
    "phi3": (hf.Phi3Config, hf.Phi3ForCausalLM, dict(SHAPE, intermediate_size=64, num_key_value_heads=2,
                                                      pad_token_id=0)),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_decoder_equals_the_targets_greedy_decoding(family):
    config_cls, model_cls, kwargs = FAMILIES[family]
    torch.manual_seed(0)
    target = Target(model_cls(config_cls(**kwargs)).to(torch.float64), None, mask_token_id=V - 1, taps=[1, 2])
    seqs = greedy_sequences(target, 32, 30)
    drafter = Drafter.untrained(target, "domino", block_size=8)
    brief_train(drafter, seqs, steps=40)
    prompts = [seqs[i, : 4 + 3 * i].tolist() for i in range(4)] + [[7, 9, 11, 13]]
    refs = [speculative_generate(target, None, prompt_ids=p, max_new_tokens=NEW).token_ids for p in prompts]
    ids = torch.tensor([prompts[0]])
    hf_out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                                   eos_token_id=3, pad_token_id=0)
    assert refs[0] == hf_out[0, ids.shape[1]:].tolist()              # plain decoding is the target's own
    accepted = 0
    for p, ref in zip(prompts, refs):
        for tree_nodes in (0, 16):
            res = speculative_generate(target, drafter, prompt_ids=p, max_new_tokens=NEW, tree_nodes=tree_nodes)
            assert res.token_ids == ref, (p, tree_nodes)
            accepted += sum(s.accepted for s in res.steps)
    assert accepted > 40                     # the drafter's tokens were taken, so caches were cut back mid-block
    for drafts, slots in (("all", None), ("adaptive", 2)):
        out = batched_generate(target, drafter, prompts, max_new_tokens=NEW, drafts=drafts, slots=slots)
        assert out.token_ids == refs, (drafts, slots)


def test_chunked_attention_decodes_as_a_chain_and_refuses_trees_and_batches():
    # Llama 4: chunked local layers (a token sees its own chunk), and a causal LM whose decoder HF's lookup misses
    from domino_lab.errors import UserError

    torch.manual_seed(0)
    cfg = hf.Llama4TextConfig(vocab_size=V, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                              attention_chunk_size=6, max_position_embeddings=256, eos_token_id=3, moe_layers=[])
    target = Target(hf.Llama4ForCausalLM(cfg).to(torch.float64), None, mask_token_id=V - 1, taps=[1, 2])
    assert target.decoder is target.model.model
    seqs = greedy_sequences(target, 32, 30)
    drafter = Drafter.untrained(target, "domino", block_size=8)
    brief_train(drafter, seqs, steps=40)
    accepted = 0
    for p in [seqs[i, : 4 + 3 * i].tolist() for i in range(4)]:
        ids = torch.tensor([p])
        ref = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                                    eos_token_id=3, pad_token_id=0)[0, len(p):].tolist()
        assert speculative_generate(target, None, prompt_ids=p, max_new_tokens=NEW).token_ids == ref
        res = speculative_generate(target, drafter, prompt_ids=p, max_new_tokens=NEW)
        assert res.token_ids == ref
        accepted += sum(s.accepted for s in res.steps)
    assert accepted > 20
    with pytest.raises(UserError, match="chunked_attention"):
        speculative_generate(target, drafter, prompt_ids=[5, 6], max_new_tokens=4, tree_nodes=8)
    with pytest.raises(UserError, match="chunked_attention"):
        batched_generate(target, drafter, [[5, 6]], max_new_tokens=4)


def test_batches_reaching_the_end_of_the_context_stay_inside_it():
    # rows of different prompt lengths run into the target's context, each at its own step, while the batch verifies
    # a whole block for every row: a row near its end must not be given positions past the context (GPT-2's learned
    # position table has no row for them), and every row still equals its own greedy decoding up to the context
    config_cls, model_cls, kwargs = FAMILIES["gpt2"]
    torch.manual_seed(0)
    ctx = 48
    target = Target(model_cls(config_cls(**dict(kwargs, n_positions=ctx))).to(torch.float64), None,
                    mask_token_id=V - 1, taps=[1, 2])
    target.eos_token_ids = set()                  # (so that every row runs into the context)
    drafter = Drafter.untrained(target, "domino", block_size=8)
    seen = []
    forward = target.forward
    target.forward = lambda *a, **k: seen.append(k.get("position_ids")) or forward(*a, **k)
    prompts = [[5 + i] * (4 + 5 * i) for i in range(4)]
    refs = [speculative_generate(target, None, prompt_ids=p, max_new_tokens=ctx).token_ids for p in prompts]
    assert [len(p) + len(r) for p, r in zip(prompts, refs)] == [ctx] * 4      # every row fills the context
    for drafts in ("all", "adaptive"):
        out = batched_generate(target, drafter, prompts, max_new_tokens=ctx, drafts=drafts)
        assert out.token_ids == refs, drafts
    assert max(int(p.max()) for p in seen if p is not None) == ctx - 1
