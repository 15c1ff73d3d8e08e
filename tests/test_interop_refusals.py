"""Hugging Face targets that domino-lab cannot decode exactly in some mode: each such mode is refused up front with one
UserError, and what still works (plain decoding, chains) equals the target's own greedy decoding."""
from __future__ import annotations

import json

import pytest
import torch
import transformers as hf

from domino_lab import Drafter, Target
from domino_lab.decoding.batched import batched_generate
from domino_lab.decoding.engine import speculative_generate
from domino_lab.errors import UserError

V = 96
SHAPE = dict(vocab_size=V, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, max_position_embeddings=128)


def hf_greedy(target: Target, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                                 pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def make_target(model: torch.nn.Module, **kw) -> Target:
    target = Target(model.to(torch.float64), None, mask_token_id=V - 1, taps=[1, 2], **kw)
    target.eos_token_ids = set()
    return target


def test_a_target_whose_forward_takes_no_cache_is_refused():
    # RWKV keeps its state in `state=`; the `cache=` every decoder passes would vanish into **kwargs
    torch.manual_seed(0)
    model = hf.RwkvForCausalLM(hf.RwkvConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                             attention_hidden_size=32, intermediate_size=64, context_length=64))
    with pytest.raises(UserError, match=r"target 'custom' \(rwkv\) takes no `cache` argument"):
        Target(model, None, mask_token_id=V - 1, taps=[0])


def test_a_longrope_target_decodes_up_to_its_original_context():
    torch.manual_seed(0)
    cfg = hf.Phi3Config(**dict(SHAPE, max_position_embeddings=256), original_max_position_embeddings=16,
                        initializer_range=0.1, pad_token_id=0, eos_token_id=None, bos_token_id=None,
                        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4,
                                         "long_factor": [4.0, 8.0, 16.0, 32.0]})
    target = make_target(hf.Phi3ForCausalLM(cfg))
    assert target.max_length == 16
    prompt = [11, 42, 7, 63, 20, 5, 88, 31]
    ref = hf_greedy(target, prompt, 8)
    drafter = Drafter.untrained(target, "dflash", block_size=8)
    for d in (None, drafter):
        # a decode asked to run past the limit stops there, as at the end of any target's context
        res = speculative_generate(target, d, prompt_ids=prompt, max_new_tokens=40)
        assert res.token_ids == ref and res.stop_reason == "context_length"
    with pytest.raises(UserError, match="has 20 tokens but the target's context is 16"):
        speculative_generate(target, None, prompt_ids=list(range(1, 21)), max_new_tokens=4)


ALIBI = {
    "mpt": lambda: hf.MptForCausalLM(hf.MptConfig(vocab_size=V, d_model=32, n_layers=4, n_heads=4, max_seq_len=128)),
    "bloom": lambda: hf.BloomForCausalLM(hf.BloomConfig(vocab_size=V, hidden_size=32, n_layer=4, n_head=4)),
    "falcon": lambda: hf.FalconForCausalLM(hf.FalconConfig(vocab_size=V, hidden_size=32, num_hidden_layers=4,
                                                           num_attention_heads=4, alibi=True)),
}


@pytest.mark.parametrize("family", list(ALIBI))
def test_alibi_targets_decode_chains_and_refuse_trees_and_batched_drafts(family):
    torch.manual_seed(0)
    target = make_target(ALIBI[family]())
    drafter = Drafter.untrained(target, "domino", block_size=6)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12]]
    refs = [hf_greedy(target, p, 12) for p in prompts]
    for p, ref in zip(prompts, refs):
        assert speculative_generate(target, None, prompt_ids=p, max_new_tokens=12).token_ids == ref
        assert speculative_generate(target, drafter, prompt_ids=p, max_new_tokens=12).token_ids == ref
    assert batched_generate(target, None, prompts, max_new_tokens=12).token_ids == refs
    with pytest.raises(UserError, match=rf"^tree verification .*target \({family}\) .*\(as ALiBi does\): use chain"):
        speculative_generate(target, drafter, prompt_ids=prompts[0], max_new_tokens=12, tree_nodes=8)
    with pytest.raises(UserError, match=r"^batched speculative decoding .*\(as ALiBi does\): decode it one sequence"):
        batched_generate(target, drafter, prompts, max_new_tokens=12)


def test_falcon_with_rotary_positions_keeps_trees():
    torch.manual_seed(0)
    target = make_target(hf.FalconForCausalLM(hf.FalconConfig(vocab_size=V, hidden_size=32, num_hidden_layers=4,
                                                              num_attention_heads=4, alibi=False)))
    assert not target.ignores_positions
    ref = speculative_generate(target, None, prompt_ids=[5, 6, 7], max_new_tokens=8).token_ids
    drafter = Drafter.untrained(target, "domino", block_size=6)
    assert speculative_generate(target, drafter, prompt_ids=[5, 6, 7], max_new_tokens=8, tree_nodes=8).token_ids == ref


def test_a_target_embedding_narrower_than_its_layers_refuses_drafters(tmp_path):
    # OPT-350m's layout: a 16-wide embedding and LM head, projected to and from 32-wide layers
    def opt(proj: int) -> Target:
        torch.manual_seed(0)
        return make_target(hf.OPTForCausalLM(hf.OPTConfig(**dict(SHAPE, num_key_value_heads=None), ffn_dim=64,
                                                          word_embed_proj_dim=proj)))

    target = opt(16)
    ref = hf_greedy(target, [5, 6, 7], 8)
    assert speculative_generate(target, None, prompt_ids=[5, 6, 7], max_new_tokens=8).token_ids == ref
    width = r"embeds tokens 16 wide but its layers are 32 wide .*: decode this target without a drafter$"
    for method in ("dflash", "domino", "eagle"):
        with pytest.raises(UserError, match=width):
            Drafter.untrained(target, method)
    Drafter.untrained(opt(32), "domino").save_pretrained(tmp_path / "d")     # (an OPT of the same shape otherwise)
    with pytest.raises(UserError, match=width):
        Drafter.from_pretrained(tmp_path / "d", target)


def test_a_recurrent_target_keeping_its_state_outside_the_cache_refuses_chains():
    # RecurrentGemma's recurrent blocks leave the cache's linear-attention layers empty: nothing there to cut back
    torch.manual_seed(0)
    target = make_target(hf.RecurrentGemmaForCausalLM(hf.RecurrentGemmaConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
        intermediate_size=64, lru_width=32, attention_window_size=6, block_types=["recurrent", "attention"])))
    assert speculative_generate(target, None, prompt_ids=[5, 6, 7], max_new_tokens=8).token_ids == \
        hf_greedy(target, [5, 6, 7], 8)
    for method in ("dflash", "eagle"):
        with pytest.raises(UserError, match=r"^speculative decoding needs a target whose linear-attention layers can "
                                            r"keep their state .*\(recurrent_gemma\) does not"):
            speculative_generate(target, Drafter.untrained(target, method), prompt_ids=[5, 6, 7], max_new_tokens=8)


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_a_model_directory_without_tokenizer_files_loads_without_a_tokenizer(tmp_path, family):
    config_cls, model_cls = {"llama": (hf.LlamaConfig, hf.LlamaForCausalLM),
                             "phi3": (hf.Phi3Config, hf.Phi3ForCausalLM)}[family]
    torch.manual_seed(0)
    model_cls(config_cls(**SHAPE, pad_token_id=0, eos_token_id=None, bos_token_id=None)).save_pretrained(tmp_path)
    target = Target.from_pretrained(str(tmp_path), taps=[1, 2])
    assert target.tokenizer is None
    res = speculative_generate(target, None, prompt_ids=[5, 6, 7], max_new_tokens=8)
    assert res.token_ids == hf_greedy(target, [5, 6, 7], 8)
    with pytest.raises(UserError, match="has no tokenizer, so a text prompt cannot be encoded"):
        speculative_generate(target, None, prompt="hello", max_new_tokens=8)


def test_a_drafter_loads_only_for_the_model_type_it_was_built_for(tmp_path):
    def target(config_cls, model_cls, seed: int, **kw) -> Target:
        torch.manual_seed(seed)
        return Target(model_cls(config_cls(**SHAPE, **kw)), None, mask_token_id=V - 1, taps=[1, 2])

    llama = target(hf.LlamaConfig, hf.LlamaForCausalLM, 0)
    mistral = target(hf.MistralConfig, hf.MistralForCausalLM, 1, sliding_window=8)
    Drafter.untrained(llama, "domino").save_pretrained(tmp_path / "d")
    cfg_file = tmp_path / "d" / "config.json"
    saved = json.loads(cfg_file.read_text())
    assert saved["target_fingerprint"]["model_type"] == "llama"
    with pytest.raises(UserError, match=r"^drafter does not fit this target: model_type drafter=llama "
                                        r"target=mistral; use a drafter trained for this target$"):
        Drafter.from_pretrained(tmp_path / "d", mistral)
    # another checkpoint of the same architecture (a fine-tuned target) is the drafter's target
    Drafter.from_pretrained(tmp_path / "d", target(hf.LlamaConfig, hf.LlamaForCausalLM, 2))
    # a drafter saved before fingerprints named the model type is checked on its shape alone
    del saved["target_fingerprint"]["model_type"]
    cfg_file.write_text(json.dumps(saved))
    Drafter.from_pretrained(tmp_path / "d", mistral)
