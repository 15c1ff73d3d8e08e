"""EAGLE-3-style autoregressive drafter (method `eagle`): the sequential baseline the block drafters are
compared against (reference/dflash_eagle.md §4).

- fused taps g = fc(concat(h_low, h_mid, h_high)) (k*H -> H, no bias);
- ONE decoder layer over [input_layernorm(E(x_{i+1})) ; hidden_norm(g_i)] (q/k/v take 2H inputs, as EAGLE-3),
  residual = the feature g_i, then post-norm SwiGLU MLP; `norm` -> the target's frozen LM head (the block
  drafters borrow it too, so the methods differ only in how they draft; FR-Spec restricts it for all of them);
- row i (RoPE position i) pairs the target feature of token i with the embedding of token i+1 and predicts
  token i+2. Drafting a chain: the row of the last committed context position (feature of x_{start-1}, embedding
  of the anchor) gives draft 0; step j > 0 feeds the layer's own pre-norm output from step j-1 as the feature
  and the embedding of draft j-1, at position start-1+j, attending causally to the cached context rows and the
  earlier draft rows (the draft rows are cropped from the cache afterwards).
- training-time test (TTT): the same unroll over a whole sequence at once; step j's row i uses step j-1's output
  at row i and attends to step-0 rows <= i plus its own row at steps 1..j (the EAGLE "diagonal"), which is
  exactly what the chain sees at inference after j self-generated features.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

from .backbone import qwen3_config, rope
from .config import DrafterConfig


class EagleAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        two_h = 2 * cfg.hidden_size                   # [embedding ; feature] (EAGLE-3)
        self.q_proj = nn.Linear(two_h, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(two_h, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(two_h, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)
        self.q_norm = Qwen3RMSNorm(self.hd, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.hd, eps=cfg.rms_norm_eps)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.nh, self.hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        return rope(q, cos, sin), rope(k, cos, sin), v

    def attend(self, q, k, v, mask) -> torch.Tensor:
        b, _, t, _ = q.shape
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.nh != self.nkv)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.nh * self.hd))


class EagleModel(nn.Module):
    """fc + one EAGLE-3 decoder layer + final norm. `step` is one layer application on rows [b, t]."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = EagleAttention(cfg)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = Qwen3MLP(qwen3_config(cfg))
        self.norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(qwen3_config(cfg))

    def qkv(self, emb: torch.Tensor, feat: torch.Tensor, pos: torch.Tensor):
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(feat)], dim=-1)
        return self.self_attn.qkv(x, *self.rotary_emb(feat, pos))

    def finish(self, feat: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual on the feature (not the embedding), then the MLP block. Returns the pre-norm output."""
        x = feat + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))

    def step(self, emb, feat, pos, mask=None, cache=None) -> torch.Tensor:
        """Rows emb, feat [b, t, H] at positions pos [b, t]; `cache` (a DynamicCache, layer 0) holds earlier rows."""
        q, k, v = self.qkv(emb, feat, pos)
        if cache is not None:
            k, v = cache.update(k, v, 0)
        return self.finish(feat, self.self_attn.attend(q, k, v, mask))


def ttt_hidden(model: EagleModel, embed, ctx_feats: torch.Tensor, input_ids: torch.Tensor, steps: int,
               rows: torch.Tensor) -> torch.Tensor:
    """Training-time test: the normed hidden states [b, N, steps, H] of the chains started at `rows` [b, N]
    (distinct per sequence). Step j of the chain at row r reads x_{r+j+1} (ground truth) and predicts x_{r+j+2}.

    Step 0 runs over every row (its keys are the causal context of all chains); steps j > 0 run only on the
    chains' rows, each attending to step-0 keys <= r and to its own keys of steps 1..j (the EAGLE diagonal), so
    the unroll costs s + (steps-1)·N rows instead of steps·s.
    """
    b, s = input_ids.shape
    dev = input_ids.device
    ar = torch.arange(s, device=dev)
    feat = model.fc(ctx_feats)
    emb = embed(input_ids.gather(1, (ar + 1).clamp(max=s - 1).expand(b, -1)))   # the last row reads a dummy
    q, k0, v0 = model.qkv(emb, feat, ar.expand(b, -1))
    out = model.finish(feat, model.self_attn.attend(q, k0, v0, ar[None, :] <= ar[:, None]))
    idx = rows[:, :, None].expand(-1, -1, out.shape[-1])
    feat = out.gather(1, idx)                                                   # [b, N, H]: each chain's step 0
    outs = [model.norm(feat)]
    ctx_mask = (ar[None, None, :] <= rows[:, :, None])[:, None]                # [b, 1, N, s]
    own = torch.eye(rows.shape[1], dtype=torch.bool, device=dev).expand(b, 1, -1, -1)
    keys, vals = [k0], [v0]
    for j in range(1, steps):
        nxt = (rows + j + 1).clamp(max=s - 1)          # past the end: a dummy token, never supervised
        q, k, v = model.qkv(embed(input_ids.gather(1, nxt)), feat, rows + j)
        keys.append(k)
        vals.append(v)
        mask = torch.cat([ctx_mask] + [own] * j, dim=-1)                        # [b, 1, N, s + j·N]
        feat = model.finish(feat, model.self_attn.attend(q, torch.cat(keys, 2), torch.cat(vals, 2), mask))
        outs.append(model.norm(feat))
    return torch.stack(outs, dim=2)


def eagle_blocks(drafter, ctx_feats, input_ids, anchors):
    """Hidden states [b, N, n, H] of the n chain steps drafted after each anchor a (draft j predicts x_{a+1+j}):
    the chain starts at row a-1 (feature of x_{a-1}, embedding of the anchor x_a). Anchor 0 has no row before
    it; the caller marks it invalid."""
    rows = (anchors - 1).clamp(min=0)
    return ttt_hidden(drafter.backbone, drafter.embed, ctx_feats, input_ids, drafter.config.num_drafts, rows)


@torch.no_grad()
def eagle_chain(drafter, ctx_feats: torch.Tensor, ctx_ids: torch.Tensor, anchor: torch.Tensor, start: int,
                cache, n: int, pick) -> None:
    """Draft a chain of n tokens. ctx_feats [1, C, kH] / ctx_ids [1, C]: the newly committed positions
    start-C..start-1 (their target features and tokens). `pick(i, hidden [1, H]) -> token [1]` turns step i's normed
    hidden state into the drafted token (greedy / sampled, FR-Spec mapping: the caller's business)."""
    from transformers import DynamicCache

    model = drafter.backbone
    cache = cache if cache is not None else DynamicCache()     # no cache given (microbenchmarks): a local one
    c = ctx_feats.shape[1]
    dev = anchor.device
    nxt = torch.cat([ctx_ids[:, 1:], anchor.view(1, 1)], dim=1)              # row i reads x_{i+1}
    pos = (start - c + torch.arange(c, device=dev))[None]
    past = cache.get_seq_length()
    # new context rows: causal among themselves, every cached row visible
    mask = torch.arange(past + c, device=dev)[None, :] <= (past + torch.arange(c, device=dev))[:, None]
    out = model.step(drafter.embed(nxt), model.fc(ctx_feats), pos, mask, cache)[:, -1:]
    tok = pick(0, model.norm(out)[:, 0])
    for i in range(1, n):
        pos = torch.tensor([[start - 1 + i]], device=dev)
        out = model.step(drafter.embed(tok.view(1, 1)), out, pos, None, cache)
        tok = pick(i, model.norm(out)[:, 0])
    if n > 1:
        cache.crop(-(n - 1))              # keep the `start` context rows; draft rows are recomputed every round
