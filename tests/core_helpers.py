"""Tiny random targets and a briefly-trained drafter, shared by the core tests.

float64 targets: with random tiny models, near-ties between the top two logits are common, and fp32
rounding differences between a 1-token and an n-token forward would flip the argmax and make
"speculative == plain greedy" flaky for reasons that have nothing to do with the algorithm.
"""
from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from domino_lab import Drafter, Target
from domino_lab.training.objective import forward_blocks, sample_anchors, weighted_ce


def tiny_target(vocab: int = 64, layers: int = 4, hidden: int = 32, eos: int | None = 3, seed: int = 0,
                logit_scale: float = 1.0, max_pos: int = 512, dtype=torch.float64) -> Target:
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                      max_position_embeddings=max_pos, eos_token_id=eos, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg).to(dtype)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return Target(model, None, mask_token_id=vocab - 1, taps=[1, layers - 2] if layers > 2 else [0])


def greedy_sequences(target: Target, n: int, length: int, seed: int = 0) -> torch.Tensor:
    """Sequences [n, 4 + length]: a random 4-token prompt then the target's own greedy continuation."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(4, target.vocab_size - 1, (n, 4), generator=g)
    with torch.no_grad():
        out = target.model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                    max_new_tokens=length, min_new_tokens=length, eos_token_id=None, pad_token_id=0)
    return out


def brief_train(drafter: Drafter, seqs: torch.Tensor, steps: int = 60, lr: float = 3e-3, seed: int = 0) -> list[float]:
    """A few optimiser steps of the shared objective on target-generated sequences (response = after the prompt)."""
    target = drafter.target
    with torch.no_grad():
        feats = target.forward(seqs, taps=drafter.config.target_layer_ids).features
    loss_mask = torch.zeros_like(seqs)
    loss_mask[:, 4:] = 1
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=lr)
    losses = []
    drafter.train()
    for _ in range(steps):
        anchors, keep = sample_anchors(loss_mask, 8, g)
        bb = forward_blocks(drafter, feats, seqs, loss_mask, anchors, keep)
        loss = 0.5 * weighted_ce(bb.logits_base, bb.labels, bb.valid, 4.0) + \
            0.5 * weighted_ce(bb.logits_final, bb.labels, bb.valid, 4.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    drafter.eval()
    return losses
