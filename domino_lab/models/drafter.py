"""Drafter = parallel backbone (+ Domino head for method 'domino'), or the EAGLE-style chain drafter (method
'eagle', models/eagle.py), bound to a frozen target.

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
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from ..errors import UserError
from .backbone import Backbone
from .config import DrafterConfig
from .domino_head import DominoHead
from .eagle import EagleModel, eagle_chain
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
        # eagle keeps the attribute name so param counts, optimisers and state dicts treat every method alike
        self.backbone = EagleModel(config) if config.method == "eagle" else Backbone(config)
        self.head = (DominoHead(config.hidden_size, config.gru_hidden, config.rank, config.vocab_size)
                     if config.method == "domino" else None)
        self.head_enabled = True   # switch the head off to get the same model's DFlash behaviour
        self._target = None
        if config.frspec_k:   # placeholder ids until set_frspec (training) or load_state_dict (a checkpoint)
            self.register_buffer("frspec_ids", torch.arange(config.frspec_k), persistent=True)
        self._fr_head = None  # (key, W_lm rows of the FR-Spec subset), rebuilt when a weight changes
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

    # ---- FR-Spec (draft vocabulary restricted to frequent tokens) ---------------------------------------
    @property
    def draft_vocab(self) -> torch.Tensor | None:
        """Sorted vocabulary ids the drafter may propose (FR-Spec), or None = the whole vocabulary."""
        return self.frspec_ids if self.config.frspec_k else None

    def set_frspec(self, ids) -> "Drafter":
        """Install the FR-Spec token list (e.g. `frspec.frequent_tokens(dataset, k)`); its length must be frspec_k."""
        ids = torch.as_tensor(list(ids), dtype=torch.long)
        k, v = self.config.frspec_k, self.config.vocab_size
        if not k:
            raise UserError("this drafter has frspec_k = 0; build it with frspec_k=K to restrict its vocabulary")
        if ids.numel() != k or ids.unique().numel() != k or int(ids.min()) < 0 or int(ids.max()) >= v:
            raise UserError(f"FR-Spec needs {k} distinct token ids in [0, {v}), got {ids.numel()}")
        self.frspec_ids.copy_(ids.sort().values.to(self.frspec_ids.device))
        return self

    def draft_lm_head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of the draft vocabulary: the full LM head, or only its FR-Spec rows (the point of FR-Spec: the
        LM-head matmul of drafting shrinks from V to K rows)."""
        vm = self.draft_vocab
        if vm is None:
            return self.lm_head(h)
        lm = self.target.lm_head
        bias = getattr(lm, "bias", None)
        key = (lm.weight.data_ptr(), lm.weight._version, vm.data_ptr(), vm._version, lm.weight.device)
        if self._fr_head is None or self._fr_head[0] != key:
            with torch.no_grad():
                self._fr_head = (key, (lm.weight[vm], bias[vm] if bias is not None else None))
        return F.linear(h, *self._fr_head[1])

    def _to_vocab(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices -> vocabulary ids."""
        vm = self.draft_vocab
        return ids if vm is None else vm[ids]

    def _q_to_vocab(self, q: torch.Tensor | None) -> torch.Tensor | None:
        """A distribution over the draft vocabulary [..., K] -> over the vocabulary [..., V] (zero elsewhere)."""
        vm = self.draft_vocab
        if vm is None or q is None:
            return q
        out = q.new_zeros(*q.shape[:-1], self.config.vocab_size)
        return out.scatter_(-1, vm.expand_as(q), q)

    def set_head(self, impl: str | None = None, candidate_pool: int | None = None) -> "Drafter":
        """Choose the head's inference path (`fused`, `fast`, `compiled`, `eager`) and candidate pool (0 = full
        vocabulary)."""
        from .config import HEAD_IMPLS
        if impl is not None:
            if impl not in HEAD_IMPLS:
                raise UserError(f"unknown head implementation '{impl}'; use one of {list(HEAD_IMPLS)}")
            self.config.head_impl = impl
        if candidate_pool is not None:
            if candidate_pool < 0:
                raise UserError(f"candidate pool must be >= 0 (0 = full vocabulary), got {candidate_pool}")
            self.config.candidate_pool = candidate_pool
        return self

    @property
    def uses_head(self) -> bool:
        return self.head is not None and self.head_enabled

    # ---- inference -----------------------------------------------------------------------------
    @torch.no_grad()
    def draft(self, ctx_feats: torch.Tensor | None, ctx_start, anchor: torch.Tensor, start, cache,
              n: int | None = None, temperature: float = 0.0, top_p: float = 1.0,
              generator: torch.Generator | None = None, topk: int = 5,
              key_valid: torch.Tensor | None = None, ctx_ids: torch.Tensor | None = None) -> Draft:
        """Propose n tokens after `anchor` (at absolute position `start`).

        ctx_feats [b, C, k*H]: target features of the newly committed positions ctx_start..start-1, appended
        to the draft cache (which then holds exactly `start` context positions). anchor: [b] token ids.
        Batched decoding with ragged acceptance passes per-row `start` ([b]), per-slot `ctx_start` ([b, C]
        positions) and `key_valid` [b, cached + C + block_size] (False = a hole left by a row that accepted fewer tokens).
        ctx_ids [b, C]: the tokens at those positions (only the eagle drafter reads them: its rows pair a feature
        with the embedding of the next token).
        """
        cfg = self.config
        n = cfg.num_drafts if n is None else min(n, cfg.num_drafts)
        if cfg.method == "eagle":
            return self._draft_eagle(ctx_feats, ctx_ids, anchor, start, cache, n, temperature, top_p, generator,
                                     topk, key_valid)
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
        fast = self.uses_head and cfg.head_impl in ("fast", "compiled", "fused")
        compiled = fast and cfg.head_impl == "compiled" and temperature <= 0
        # the compiled rollout always drafts every slot (one graph per shape), then keeps the first n
        m = cfg.num_drafts if compiled else n
        h = hs[:, cfg.first_draft_slot: cfg.first_draft_slot + m]
        base = self.draft_lm_head(h)         # [b, n, V] (FR-Spec: [b, n, K]): all slots in one parallel pass
        k = min(topk, base.shape[-1])
        bt = base[:, :n].topk(k, dim=-1)
        bt = (self._to_vocab(bt.indices), bt.values)
        if fast:
            r = self.head.rollout(h, base, anchor, self.target.embed_tokens.weight, cfg.candidate_pool,
                                  temperature, top_p, generator, impl=cfg.head_impl, vocab_ids=self.draft_vocab,
                                  topk=k)
            if r.top is not None:            # the fused loop ranked the final logits itself (and drafted n slots)
                return Draft(r.tokens, r.q, bt, r.top)
            logits = r.logits[:, :n]
            ft = logits.topk(min(k, logits.shape[-1]), dim=-1)
            f_ids = ft.indices if r.ids is None else r.ids.unsqueeze(1).expand_as(logits).gather(-1, ft.indices)
            f_vals = ft.values
            if r.ids is not None and f_vals.shape[-1] == k:      # draft 0 is uncorrected: its final = base
                f_ids, f_vals = f_ids.clone(), f_vals.clone()
                f_ids[:, 0], f_vals[:, 0] = bt[0][:, 0], bt[1][:, 0]
            return Draft(r.tokens[:, :n], r.q, bt, (f_ids, f_vals))
        if not self.uses_head:               # no correction: the final logits are the base logits
            tokens, q = sample_from(base.flatten(0, 1), temperature, top_p, generator)
            q = self._q_to_vocab(q.view(*base.shape)) if q is not None else None
            return Draft(self._to_vocab(tokens.view(base.shape[:2])), q, bt, bt)
        tokens, finals, qs = [], [], []
        state = None
        prev = anchor
        for i in range(n):                   # the eager head: the reference the fast paths are checked against
            logits = base[:, i]
            # The GRU has now consumed [anchor, d_0..d_{i-1}]; draft 0 has nothing to condition on.
            state = self.head.step(self.embed(prev), state)
            if i > 0:
                delta = self.head.correction(h[:, i], state)
                logits = logits + (delta if self.draft_vocab is None else delta[:, self.draft_vocab])
            tok, q = sample_from(logits, temperature, top_p, generator)
            tok = self._to_vocab(tok)
            tokens.append(tok)
            finals.append(logits)
            qs.append(self._q_to_vocab(q))
            prev = tok
        ft = torch.stack(finals, dim=1).topk(k, dim=-1)
        q = torch.stack(qs, dim=1) if temperature > 0 else None
        return Draft(torch.stack(tokens, dim=1), q, bt, (self._to_vocab(ft.indices), ft.values))

    def _draft_eagle(self, ctx_feats, ctx_ids, anchor, start, cache, n, temperature, top_p, generator, topk,
                     key_valid) -> Draft:
        """The eagle chain (models/eagle.py): one layer step per draft; single sequence only (the ragged batched
        decoder refuses eagle)."""
        if anchor.shape[0] != 1 or key_valid is not None or torch.as_tensor(start).numel() != 1:
            raise UserError("the eagle drafter decodes one sequence at a time; use speculative_generate "
                            "(batched decoding supports dflash and domino)")
        if ctx_feats is None or ctx_feats.shape[1] == 0 or ctx_ids is None:
            raise UserError("the eagle drafter needs the newly committed positions' features and token ids "
                            "(ctx_feats, ctx_ids) at every draft call")
        tokens, logits_all, qs = [], [], []

        def pick(i: int, hidden: torch.Tensor) -> torch.Tensor:
            logits = self.draft_lm_head(hidden)                      # [1, V] (FR-Spec: [1, K])
            tok, q = sample_from(logits, temperature, top_p, generator)
            tok = self._to_vocab(tok)
            tokens.append(tok)
            logits_all.append(logits)
            qs.append(self._q_to_vocab(q))
            return tok

        eagle_chain(self, ctx_feats, ctx_ids, anchor, int(torch.as_tensor(start).reshape(-1)[0]), cache, n, pick)
        lg = torch.stack(logits_all, dim=1)
        t = lg.topk(min(topk, lg.shape[-1]), dim=-1)
        top = (self._to_vocab(t.indices), t.values)        # one set of logits: base = final
        q = torch.stack(qs, dim=1) if temperature > 0 else None
        return Draft(torch.stack(tokens, dim=1), q, top, top)

    # ---- teacher-forced logits (training and tests) ----------------------------------------------
    def draft_logits(self, h: torch.Tensor, prefix_tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """h [M, n, H] hidden states of the draft slots; prefix_tokens [M, n] = [anchor, t_0..t_{n-2}]
        (teacher forcing: ground truth; TTT: the drafter's own tokens). Returns (base, final) logits."""
        base = self.lm_head(h)    # training and teacher-forced checks score the full vocabulary (FR-Spec: drafting)
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


def load_drafter(spec: str | None, target, block_size: int | None = None, seed: int = 0,
                 head_impl: str | None = None, candidate_pool: int | None = None) -> Drafter | None:
    """Resolve a CLI drafter spec: 'none', 'untrained:dflash|domino|eagle', a shipped name, or a checkpoint dir;
    `head_impl` / `candidate_pool` override the head's inference path (None keeps the checkpoint's)."""
    if spec is None or spec == "none":
        return None
    return _resolve_drafter(spec, target, block_size, seed).set_head(head_impl, candidate_pool)


def add_head_args(p) -> None:
    """--head-impl / --candidate-pool for every CLI that loads a drafter (None = the checkpoint's own setting)."""
    from .config import HEAD_IMPLS
    p.add_argument("--head-impl", default=None, choices=HEAD_IMPLS,
                   help="Domino head inference path: fused (one C++ loop, CPU greedy), fast (table + pool in torch ops), "
                        "compiled (torch.compile), eager (reference)")
    p.add_argument("--candidate-pool", type=int, default=None,
                   help="score the head's correction on the top-K candidates only (0 = full vocabulary, exact)")


def _resolve_drafter(spec: str, target, block_size: int | None, seed: int) -> Drafter:
    if spec.startswith("untrained:"):
        method = spec.split(":", 1)[1]
        overrides = {"block_size": block_size} if block_size else {}
        return Drafter.untrained(target, method, seed=seed, **overrides)
    if spec in SHIPPED_DRAFTERS and not (SHIPPED_DRAFTERS[spec] / "config.json").exists():
        raise UserError(f"the shipped drafter '{spec}' is not in this install; train one with "
                        "`python -m domino_lab.train` or use 'untrained:domino' / a checkpoint directory")
    return Drafter.from_pretrained(spec, target)
