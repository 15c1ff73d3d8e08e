"""Drafter = parallel backbone (+ Domino head for method 'domino'), bound to a frozen target.

The drafter owns no embedding and no LM head: it borrows the target's (frozen), so its checkpoint is
only the backbone and head weights plus `config.json`.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..errors import UserError
from .backbone import Backbone
from .config import DrafterConfig
from .domino_head import DominoHead
from ..decoding.sampling import sample_from

ASSETS = Path(__file__).resolve().parent.parent / "assets"
# Shipped drafters for the embedded target (issue 4 trains them).
SHIPPED_DRAFTERS = {"default": ASSETS / "drafter-domino", "default-domino": ASSETS / "drafter-domino",
                    "default-dflash": ASSETS / "drafter-dflash"}


@dataclass
class Draft:
    tokens: torch.Tensor             # [b, n] proposed tokens
    q: torch.Tensor | None           # [b, n, V] the exact distributions they were sampled from (T>0 only)
    base_topk: tuple[torch.Tensor, torch.Tensor]    # (ids, logits) [b, n, k]
    final_topk: tuple[torch.Tensor, torch.Tensor]   # (ids, logits) [b, n, k]


class Drafter(nn.Module):
    def __init__(self, config: DrafterConfig, target=None):
        super().__init__()
        self.config = config
        self.backbone = Backbone(config)
        self.head = (DominoHead(config.hidden_size, config.gru_hidden, config.rank, config.vocab_size)
                     if config.method == "domino" else None)
        self.head_enabled = True   # switch the head off to get the same model's DFlash behaviour
        self._target = None
        self._init_weights()
        if target is not None:
            self.bind(target)

    def _init_weights(self):
        # HF post_init style: N(0, 0.02) linears; RMSNorm weights stay 1; the GRU keeps PyTorch's default.
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    # ---- target binding ------------------------------------------------------------------------
    def bind(self, target) -> "Drafter":
        self.config.check_target(target)
        if not self.config.target_fingerprint:
            self.config.target_fingerprint = target.fingerprint
        self.__dict__["_target"] = target    # not a submodule: never saved, never trained
        return self.to(device=target.device, dtype=target.dtype)

    @property
    def target(self):
        if self._target is None:
            raise RuntimeError("drafter is not bound to a target; call drafter.bind(target)")
        return self._target

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.target.embed_tokens(ids)

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        return self.target.lm_head(h)

    @property
    def uses_head(self) -> bool:
        return self.head is not None and self.head_enabled

    # ---- inference -----------------------------------------------------------------------------
    @torch.no_grad()
    def draft(self, ctx_feats: torch.Tensor | None, ctx_start, anchor: torch.Tensor, start, cache,
              n: int | None = None, temperature: float = 0.0, top_p: float = 1.0,
              generator: torch.Generator | None = None, topk: int = 5,
              key_valid: torch.Tensor | None = None) -> Draft:
        """Propose n tokens after `anchor` (at absolute position `start`).

        ctx_feats [b, C, k*H]: target features of the newly committed positions ctx_start..start-1, appended
        to the draft cache (which then holds exactly `start` context positions). anchor: [b] token ids.
        Batched decoding with ragged acceptance passes per-row `start` ([b]), per-slot `ctx_start` ([b, C]
        positions) and `key_valid` [b, cached + C + block_size] (False = a hole left by a row that accepted fewer tokens).
        """
        cfg = self.config
        n = cfg.num_drafts if n is None else min(n, cfg.num_drafts)
        b = anchor.shape[0]
        dev = anchor.device
        block_ids = torch.full((b, cfg.block_size), cfg.mask_token_id, dtype=torch.long, device=dev)
        block_ids[:, 0] = anchor
        start = torch.as_tensor(start, device=dev).reshape(-1, 1)
        block_pos = (start + torch.arange(cfg.block_size, device=dev)).expand(b, -1)
        ctx_pos = None
        if ctx_feats is not None:
            ctx_start = torch.as_tensor(ctx_start, device=dev)
            ctx_pos = ctx_start if ctx_start.dim() == 2 else (      # [b, C]: every slot's own position
                ctx_start.reshape(-1, 1) + torch.arange(ctx_feats.shape[1], device=dev)).expand(b, -1)
        mask = key_valid[:, None, None, :] if key_valid is not None else None    # broadcast over heads, queries
        hs = self.backbone(self.embed(block_ids), block_pos, ctx_feats, ctx_pos, mask=mask, cache=cache)
        if cache is not None:
            cache.crop(-cfg.block_size)      # keep context K/V only; block K/V are recomputed every round
        h = hs[:, cfg.first_draft_slot: cfg.first_draft_slot + n]
        base = self.lm_head(h)               # [b, n, V]: all slots in one parallel pass
        tokens, finals, qs = [], [], []
        state = None
        prev = anchor
        for i in range(n):
            logits = base[:, i]
            if self.uses_head:
                # The GRU has now consumed [anchor, d_0..d_{i-1}]; draft 0 has nothing to condition on.
                state = self.head.step(self.embed(prev), state)
                if i > 0:
                    logits = logits + self.head.correction(h[:, i], state)
            tok, q = sample_from(logits, temperature, top_p, generator)
            tokens.append(tok)
            finals.append(logits)
            qs.append(q)
            prev = tok
        final = torch.stack(finals, dim=1)
        k = min(topk, final.shape[-1])
        bt = base.topk(k, dim=-1)
        ft = final.topk(k, dim=-1)
        q = torch.stack(qs, dim=1) if temperature > 0 else None
        return Draft(torch.stack(tokens, dim=1), q, (bt.indices, bt.values), (ft.indices, ft.values))

    # ---- teacher-forced logits (training and tests) ----------------------------------------------
    def draft_logits(self, h: torch.Tensor, prefix_tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """h [M, n, H] hidden states of the draft slots; prefix_tokens [M, n] = [anchor, t_0..t_{n-2}]
        (teacher forcing: ground truth; TTT: the drafter's own tokens). Returns (base, final) logits."""
        base = self.lm_head(h)
        if not self.uses_head or prefix_tokens is None:
            return base, base
        return base, self.head.corrected_logits(h, base, self.embed(prefix_tokens))

    # ---- bookkeeping ---------------------------------------------------------------------------
    def param_counts(self) -> dict:
        backbone = sum(p.numel() for p in self.backbone.parameters())
        head = sum(p.numel() for p in self.head.parameters()) if self.head is not None else 0
        return {"backbone": backbone, "head": head, "total": backbone + head,
                "head_over_backbone_pct": round(100.0 * head / backbone, 2)}

    def save_pretrained(self, out_dir: str | os.PathLike) -> Path:
        """config.json + model.safetensors, written to a temp dir and renamed into place."""
        out = Path(out_dir)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            (tmp / "config.json").write_text(self.config.to_json())
            state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt", "method": self.config.method})
            if out.exists():
                shutil.rmtree(out)
            os.replace(tmp, out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
        return out

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, target) -> "Drafter":
        path = Path(path)
        if str(path) in SHIPPED_DRAFTERS:
            path = SHIPPED_DRAFTERS[str(path)]
        cfg_file, weights = path / "config.json", path / "model.safetensors"
        if not cfg_file.exists() or not weights.exists():
            raise UserError(f"drafter '{path}' is not a drafter directory (needs config.json and model.safetensors); "
                            "pass a directory written by Drafter.save_pretrained / domino_lab.train")
        try:
            cfg = DrafterConfig.from_dict(json.loads(cfg_file.read_text()))
        except (json.JSONDecodeError, TypeError) as e:
            raise UserError(f"drafter config {cfg_file} is malformed: {e}") from None
        cfg.check_target(target)
        drafter = cls(cfg)
        drafter.load_state_dict(load_file(str(weights)), strict=True)
        return drafter.bind(target)

    @classmethod
    def untrained(cls, target, method: str = "domino", seed: int = 0, **overrides) -> "Drafter":
        """A freshly initialised, seeded drafter for `target` (teaching, tests, `untrained:<method>`)."""
        torch.manual_seed(seed)
        return cls(DrafterConfig.for_target(target, method, **overrides), target)


def load_drafter(spec: str | None, target, block_size: int | None = None, seed: int = 0) -> Drafter | None:
    """Resolve a CLI drafter spec: 'none', 'untrained:dflash|domino', a shipped name, or a checkpoint dir."""
    if spec is None or spec == "none":
        return None
    if spec.startswith("untrained:"):
        method = spec.split(":", 1)[1]
        overrides = {"block_size": block_size} if block_size else {}
        return Drafter.untrained(target, method, seed=seed, **overrides)
    if spec in SHIPPED_DRAFTERS and not (SHIPPED_DRAFTERS[spec] / "config.json").exists():
        raise UserError(f"the shipped drafter '{spec}' is not in this install; train one with "
                        "`python -m domino_lab.train` or use 'untrained:domino' / a checkpoint directory")
    return Drafter.from_pretrained(spec, target)
