"""The parallel draft backbone (DFlash-style): one pass proposes hidden states for a whole block.

Queries come from the block only; keys/values are [context ; block], where the context is the fused
target features projected by *each layer's own* k/v projections (KV injection). Inside the block the
attention is bidirectional; a block sees only context strictly before its anchor (at inference the
anchor's own target state does not exist yet). Positions are absolute: context 0..S-1, block a..a+B-1.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from .config import DrafterConfig


def qwen3_config(cfg: DrafterConfig) -> Qwen3Config:
    """The HF config our borrowed Qwen3 pieces (MLP, RMSNorm, RoPE) are built from."""
    return Qwen3Config(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                       num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                       head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, vocab_size=cfg.vocab_size,
                       max_position_embeddings=cfg.max_position_embeddings, num_hidden_layers=cfg.num_layers,
                       rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta})


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, heads, t, d]; cos/sin: [b, t, d]."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class DraftAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)
        self.q_norm = Qwen3RMSNorm(self.hd, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.hd, eps=cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        return rope(k, cos, sin), v

    def forward(self, x, ctx, blk_rope, kv_rope, mask=None, cache=None):
        """x: block states [b, Q, H] (already layer-normed); ctx: fused context [b, C, H] or None; blk_rope the
        block's (cos, sin), kv_rope those of [context ; block] (the block's alone without context)."""
        # context and block share the k/v projections: one matmul over [context ; block] (at inference a few
        # committed positions and a block, where each extra small op costs about what its arithmetic does)
        k, v = self.kv(torch.cat([ctx, x], dim=1) if ctx is not None else x, *kv_rope)
        if cache is not None:
            # The cache holds earlier context K/V; the caller crops the block part off afterwards.
            k, v = cache.update(k, v, self.layer_idx)
        return self.attend(x, k, v, blk_rope, mask)

    def queries(self, x, blk_rope):
        """The block's queries [b, heads, Q, d] from x [b, Q, H]."""
        b, q_len, _ = x.shape
        return rope(self.q_norm(self.q_proj(x).view(b, q_len, self.nh, self.hd)).transpose(1, 2), *blk_rope)

    def attend(self, x, k, v, blk_rope, mask=None):
        """The block's queries from x [b, Q, H] over keys / values [b, kv heads, T, d], projected back."""
        out = F.scaled_dot_product_attention(self.queries(x, blk_rope), k, v, attn_mask=mask,
                                             enable_gqa=self.nh != self.nkv)
        return self.o_proj(out.transpose(1, 2).flatten(2))

    def attend_cached(self, x, past_k, past_v, k, v, blk_rope):
        """`attend` without a mask over two parts of keys / values, the cached ones and the new ones, without
        joining them: one softmax over both parts' scores, then each part's share of the values. At inference a
        block's ~10 queries meet a cache of hundreds of positions, and joining would copy the whole cache every
        step; written as plain products (query heads grouped by the key head they share), torch.compile fuses the
        scaling, the softmax and the sum, where the fused attention kernel costs more to set up than it computes
        (docs/design.md#compiled-backbone)."""
        b, q_len, _ = x.shape
        # [b, kv heads, (heads per kv head) * Q, d]: query head h reads key head h // (nh / nkv), as enable_gqa
        q = self.queries(x, blk_rope).reshape(b, self.nkv, self.nh // self.nkv * q_len, self.hd) * self.hd ** -0.5
        n = past_k.shape[2]
        # (the softmax in float32 whatever the weights' dtype, as the fused kernel does)
        p = torch.cat([q @ past_k.transpose(-1, -2), q @ k.transpose(-1, -2)], dim=-1).softmax(-1, torch.float32)
        p = p.to(v.dtype)
        out = (p[..., :n] @ past_v + p[..., n:] @ v).view(b, self.nh, q_len, self.hd)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DraftAttention(cfg, layer_idx)
        self.mlp = Qwen3MLP(qwen3_config(cfg))
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x, ctx, blk_rope, kv_rope, mask=None, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), ctx, blk_rope, kv_rope, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """fused taps -> fc -> RMSNorm context; N draft layers; final norm. Returns normed H for every slot."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg, i) for i in range(cfg.num_layers))
        self.block_size = cfg.block_size
        self.anchor_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False) if cfg.anchor_feature else None
        self.norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(qwen3_config(cfg))

    def forward(self, block_emb: torch.Tensor, block_pos: torch.Tensor, ctx_feats: torch.Tensor | None,
                ctx_pos: torch.Tensor | None, mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """block_emb [b, Q, H] at positions block_pos [b, Q]; ctx_feats [b, C, k*H] at ctx_pos [b, C].

        mask: boolean [b, 1, Q, C + Q] (True = may attend) for training; None at inference, where every
        cached context position precedes the anchor and the block is fully bidirectional.
        """
        ctx = self.hidden_norm(self.fc(ctx_feats)) if ctx_feats is not None else None
        if self.anchor_proj is not None:
            block_emb = block_emb + self.anchor_proj(self.anchor_context(ctx, ctx_pos, block_pos))
        if ctx is not None and ctx.shape[1] == 0:
            ctx = None
        # one rotary table over [context ; block]: the keys' positions; the queries' are its block part
        kv_rope = self.rotary_emb(block_emb, torch.cat([ctx_pos, block_pos], 1) if ctx is not None else block_pos)
        q = block_pos.shape[1]
        blk_rope = tuple(t[:, -q:] for t in kv_rope)
        x = block_emb
        for layer in self.layers:
            x = layer(x, ctx, blk_rope, kv_rope, mask, cache)
        return self.norm(x)

    def infer(self, block_emb: torch.Tensor, ctx_feats: torch.Tensor, pos: torch.Tensor,
              kv: list[tuple[torch.Tensor, torch.Tensor]], n: int) -> torch.Tensor:
        """`forward` at inference with the draft cache's key and value buffers as plain tensors, so that torch.compile
        can take the whole pass as one graph (a cache object's update is Python it cannot trace): the block
        `block_emb` [b, B, H] after C new context positions `ctx_feats` [b, C, k*H], positions `pos` [b, C + B]
        (context, then block), `kv` every layer's (keys, values) buffers [b, kv heads, T, d] with their first n
        positions cached and room for C more. Each layer writes its new context's keys and values into positions
        n..n+C-1 of its buffers, then attends over the buffers' first n + C positions and the block's own keys and
        values. In this order a compiled graph writes only the new positions; with the write after the attention
        inductor rewrote the whole buffer every step (docs/design.md#compiled-backbone). Returns the block's normed
        states."""
        c, q = ctx_feats.shape[1], block_emb.shape[1]
        ctx = self.hidden_norm(self.fc(ctx_feats))
        if self.anchor_proj is not None:
            block_emb = block_emb + self.anchor_proj(self.anchor_context(ctx, pos[:, :c], pos[:, c:]))
        kv_rope = self.rotary_emb(block_emb, pos)
        blk_rope = tuple(t[:, -q:] for t in kv_rope)
        x = block_emb
        for layer, (kb, vb) in zip(self.layers, kv):
            a, h = layer.self_attn, layer.input_layernorm(x)
            k, v = a.kv(torch.cat([ctx, h], dim=1), *kv_rope)
            kb[:, :, n:n + c] = k[:, :, :c]
            vb[:, :, n:n + c] = v[:, :, :c]
            x = x + a.attend_cached(h, kb[:, :, :n + c], vb[:, :, :n + c], k[:, :, c:], v[:, :, c:], blk_rope)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    def anchor_context(self, ctx: torch.Tensor | None, ctx_pos: torch.Tensor | None,
                       block_pos: torch.Tensor) -> torch.Tensor:
        """For every block slot, the fused context state at position anchor-1 ([b, Q, H]).

        Slot j of a block sits at anchor + j, so the anchor of slot q is block_pos[q] - q % B. Training passes the
        whole sequence as context; inference passes the new context, which always ends at anchor-1 (the verified
        tokens before the anchor). A slot whose position is missing gets zeros (padding rows of a batch)."""
        if ctx is None:
            raise ValueError("anchor_feature needs the context up to the anchor; got no context features")
        q = block_pos.shape[1]
        want = block_pos - torch.arange(q, device=block_pos.device) % self.block_size - 1          # [b, Q]
        match = ctx_pos[:, None, :] == want[:, :, None]                                           # [b, Q, C]
        # the last matching entry (positions are unique per row; padding never carries anchor-1)
        idx = (match.shape[-1] - 1 - match.flip(-1).float().argmax(-1)).clamp_min(0)
        feat = ctx.gather(1, idx[..., None].expand(-1, -1, ctx.shape[-1]))
        return feat * match.any(-1, keepdim=True).to(feat.dtype)


def block_attention_mask(anchors: torch.Tensor, keep: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Training mask for N blocks of one forward, keys laid out as [context (S) | block_0 | ... | block_{N-1}].

    anchors, keep: [b, N]. Query (block i, slot j) may see context position c iff c < anchors[i], and every
    slot of its own block; blocks never see each other. Dropped blocks (keep=False) see only themselves, so
    no row is empty. Returns bool [b, 1, N*B, S + N*B].
    """
    b, n = anchors.shape
    ctx_ok = torch.arange(seq_len, device=anchors.device)[None, None, :] < anchors[:, :, None]   # [b, N, S]
    ctx_ok = ctx_ok & keep[:, :, None]
    ctx_ok = ctx_ok.repeat_interleave(block_size, dim=1)                                         # [b, N*B, S]
    blk_id = torch.arange(n * block_size, device=anchors.device) // block_size
    same = (blk_id[:, None] == blk_id[None, :]).expand(b, -1, -1)                                # [b, N*B, N*B]
    return torch.cat([ctx_ok, same], dim=-1).unsqueeze(1)
