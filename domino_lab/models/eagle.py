"""EAGLE-3-style autoregressive drafter (method `eagle`): the sequential baseline the block drafters are
compared against (docs/design.md#the-eagle-style-chain).

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

from ..errors import UserError
from ..sampling import sample_from
from .backbone import qwen3_config, rope
from .config import DrafterConfig
from .drafter import BlockBatch, Draft, Drafter, draft_labels
from .frspec import add_noise, q_to_vocab, to_vocab
from .registry import register


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


@register("eagle")
class EagleDrafter(Drafter):
    """The chain: one layer step per draft, its own previous output as the feature after step 0."""
    supports_batched = False     # its caches hold draft rows per sequence; the ragged batched decoder has none

    @classmethod
    def check_config(cls, config: DrafterConfig) -> None:
        if config.num_layers != 1:
            raise UserError(f"the eagle drafter has exactly one decoder layer (EAGLE-3); got "
                            f"num_layers={config.num_layers}")
        if config.copy_ngram:
            raise UserError("the copy input (copy_ngram > 0) is for block drafters (dflash, domino); the eagle "
                            "drafter drafts one token at a time: use copy_ngram 0, or lookup drafting (--lookup)")

    def build(self, config: DrafterConfig) -> None:
        self.chain = EagleModel(config)
        # checkpoints written before the families were split named this module `backbone`
        self._register_load_state_dict_pre_hook(_legacy_chain_keys)

    def body_parts(self) -> dict[str, nn.Module]:
        return {"backbone": self.chain}

    @torch.no_grad()
    def draft(self, ctx_feats, ctx_start, anchor, start, cache, n=None, temperature=0.0, top_p=1.0, generator=None,
              topk=5, key_valid=None, ctx_ids=None, copy=None, noise=None) -> Draft:
        """Single sequence only: the batched decoder asks `supports_batched` and refuses eagle."""
        n = self.config.num_drafts if n is None else min(n, self.config.num_drafts)
        if anchor.shape[0] != 1 or key_valid is not None or torch.as_tensor(start).numel() != 1:
            raise UserError("the eagle drafter decodes one sequence at a time; use speculative_generate "
                            "(batched decoding supports the block drafters)")
        if ctx_feats is None or ctx_feats.shape[1] == 0 or ctx_ids is None:
            raise UserError("the eagle drafter needs the newly committed positions' features and token ids "
                            "(ctx_feats, ctx_ids) at every draft call")
        vm = self.draft_vocab
        tokens, logits_all, qs = [], [], []

        def pick(i: int, hidden: torch.Tensor) -> torch.Tensor:
            logits = self.draft_lm_head(hidden)                      # [1, V] (FR-Spec: [1, K])
            if noise is not None:                                    # Gumbel-coupled sampling: step i's noise
                logits = add_noise(logits[:, None], noise[:, i: i + 1], vm)[:, 0]
            tok, q = sample_from(logits, temperature, top_p, generator)
            tok = to_vocab(tok, vm)
            tokens.append(tok)
            logits_all.append(logits)
            qs.append(q_to_vocab(q, vm, self.config.vocab_size))
            return tok

        eagle_chain(self, ctx_feats, ctx_ids, anchor, int(torch.as_tensor(start).reshape(-1)[0]), cache, n, pick)
        lg = torch.stack(logits_all, dim=1)
        t = lg.topk(min(topk, lg.shape[-1]), dim=-1)
        top = (to_vocab(t.indices, vm), t.values)        # one set of logits: base = final
        q = torch.stack(qs, dim=1) if temperature > 0 else None
        return Draft(torch.stack(tokens, dim=1), q, top, top)

    def training_blocks(self, ctx_feats, input_ids, loss_mask, anchors, keep, prefix_mode="teacher_forcing",
                        copy=None) -> BlockBatch:
        """Training-time test: n chain steps from each anchor, ground-truth tokens with the drafter's own features
        after step 0 (prefix_mode does not apply: that is EAGLE-3's training). Step j, read at the row before the
        anchor a, predicts x_{a+1+j}: the same [b, N, n, V] layout as the block drafters'."""
        n = self.config.num_drafts
        labels, valid = draft_labels(input_ids, loss_mask, anchors, keep, n)
        valid = valid & (anchors >= 1)[:, :, None]          # the chain starts at the row before the anchor
        rows = (anchors - 1).clamp(min=0)
        logits = self.lm_head(ttt_hidden(self.chain, self.embed, ctx_feats, input_ids, n, rows))
        prefix = torch.cat([input_ids.gather(1, anchors)[:, :, None], labels[:, :, :-1]], dim=-1)
        return BlockBatch(logits, logits, labels, valid, prefix)


def _legacy_chain_keys(state_dict, prefix, *_):
    for k in [k for k in state_dict if k.startswith(prefix + "backbone.")]:
        state_dict[prefix + "chain." + k[len(prefix + "backbone."):]] = state_dict.pop(k)


@torch.no_grad()
def eagle_chain(drafter, ctx_feats: torch.Tensor, ctx_ids: torch.Tensor, anchor: torch.Tensor, start: int,
                cache, n: int, pick) -> None:
    """Draft a chain of n tokens. ctx_feats [1, C, kH] / ctx_ids [1, C]: the newly committed positions
    start-C..start-1 (their target features and tokens). `pick(i, hidden [1, H]) -> token [1]` turns step i's normed
    hidden state into the drafted token (greedy / sampled, FR-Spec mapping: the caller's business)."""
    from transformers import DynamicCache

    model = drafter.chain
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
