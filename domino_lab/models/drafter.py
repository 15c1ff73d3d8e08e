"""Drafter: what every drafter family shares, bound to a frozen target.

A drafter owns no embedding and no LM head: it borrows the target's (frozen), so its checkpoint is only its own
weights plus `config.json`. The families (models/registry.py) add how they draft and how they are trained:
`Drafter(config)` builds the family registered for `config.method`.
"""
from __future__ import annotations

import json
import os
import re
from abc import ABCMeta, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from ..errors import UserError, atomic_dir
from .config import DrafterConfig
from .options import InferenceOptions
from .packed_linear import linear, use_packed
from .weights_file import safetensors_shapes
from . import registry

ASSETS = Path(__file__).resolve().parent.parent / "assets"
# Drafters shipped for the embedded target (experiments/train_default_drafters.py trains them) in two stages: 4,000
# steps on math and code responses (`*-mc`), then 800 steps on data a third of which answers prose prompts (the
# names without a suffix; docs/design.md#prose-domain). The block drafters read a copy input
# (docs/design.md#copy-input); `*-nocopy` are the stage-1 recipes without it, which the results committed before the
# copy input was shipped as the default call `default` and `default-dflash`. Results committed before the prose stage
# was shipped call the `*-mc` drafters `default`, `default-dflash` and `default-eagle` (and `default-copy`,
# `default-dflash-copy`, which still name them).
SHIPPED_DRAFTERS = {"default": ASSETS / "drafter-domino-prose", "default-domino": ASSETS / "drafter-domino-prose",
                    "default-dflash": ASSETS / "drafter-dflash-prose", "default-eagle": ASSETS / "drafter-eagle-prose",
                    "default-mc": ASSETS / "drafter-domino-copy", "default-dflash-mc": ASSETS / "drafter-dflash-copy",
                    "default-eagle-mc": ASSETS / "drafter-eagle",
                    "default-copy": ASSETS / "drafter-domino-copy",
                    "default-dflash-copy": ASSETS / "drafter-dflash-copy",
                    "default-nocopy": ASSETS / "drafter-domino", "default-dflash-nocopy": ASSETS / "drafter-dflash"}


@dataclass
class Draft:
    tokens: torch.Tensor             # [b, n] proposed tokens
    q: torch.Tensor | None           # [b, n, V] the exact distributions they were sampled from (T>0 only)
    base_topk: tuple[torch.Tensor, torch.Tensor]    # (ids, logits) [b, n, k]
    final_topk: tuple[torch.Tensor, torch.Tensor]   # (ids, logits) [b, n, k]


@dataclass
class BlockBatch:
    """Training logits of N blocks per sequence, the same layout for every family."""
    logits_base: torch.Tensor    # [b, N, n, V]
    logits_final: torch.Tensor   # [b, N, n, V] (= logits_base for families without a correction)
    labels: torch.Tensor         # [b, N, n]
    valid: torch.Tensor          # [b, N, n] bool
    prefix: torch.Tensor         # [b, N, n] tokens read before each draft


def draft_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor,
                 n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels x_{a+1+i} [b, N, n] of every anchor's drafts, and which of them are supervised."""
    b, s = input_ids.shape
    lab_pos = anchors[:, :, None] + 1 + torch.arange(n, device=input_ids.device)     # [b, N, n]
    in_range = lab_pos < s
    lab_pos_c = lab_pos.clamp(max=s - 1).view(b, -1)
    labels = input_ids.gather(1, lab_pos_c).view(b, -1, n)
    valid = in_range & loss_mask.gather(1, lab_pos_c).view(b, -1, n).bool() & keep[:, :, None]
    return labels, valid


class Drafter(nn.Module, metaclass=ABCMeta):
    """A family subclass implements the abstract methods and registers itself (models/registry.py)."""
    supports_batched = True     # can draft for several rows with ragged caches (decoding/batched.py)
    has_head = False            # has a correction trained with the λ curriculum

    def __new__(cls, config: DrafterConfig | None = None, target=None):
        if cls is Drafter:      # Drafter(config) builds the family registered for config.method
            cls = registry.family(config.method)
        return super().__new__(cls)

    def __init__(self, config: DrafterConfig, target=None):
        super().__init__()
        self.config = config
        self.options = InferenceOptions()   # how it is run: never saved (see set_options)
        self.head_enabled = True            # a family with a head: switch it off to get the same model without it
        self._target = None
        if config.frspec_k:   # placeholder ids until set_frspec (training) or load_state_dict (a checkpoint)
            self.register_buffer("frspec_ids", torch.arange(config.frspec_k), persistent=True)
        self._fr_head = None  # (key, W_lm rows of the FR-Spec subset, its token ids as a set), rebuilt on change
        self.build(config)
        # its linear layers through oneDNN's packed weights where measured faster; calls that autograd records
        # (training) keep F.linear (packed_linear.py)
        use_packed(self)
        self._init_weights()
        if target is not None:
            self.bind(target)

    # ---- what a family provides ------------------------------------------------------------------
    @classmethod
    def check_config(cls, config: DrafterConfig) -> None:
        """Family-specific rules on the architecture (called when a DrafterConfig is made)."""

    @abstractmethod
    def build(self, config: DrafterConfig) -> None:
        """Create the family's modules."""

    @abstractmethod
    def draft(self, ctx_feats: torch.Tensor | None, ctx_start, anchor: torch.Tensor, start, cache,
              n: int | None = None, temperature: float = 0.0, top_p: float = 1.0,
              generator: torch.Generator | None = None, topk: int = 5,
              key_valid: torch.Tensor | None = None, ctx_ids: torch.Tensor | None = None,
              copy: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
              noise: torch.Tensor | None = None) -> Draft:
        """Propose n tokens after `anchor` (at absolute position `start`).

        ctx_feats [b, C, k*H]: target features of the newly committed positions ctx_start..start-1, appended
        to the draft cache (which then holds exactly `start` context positions). anchor: [b] token ids.
        Batched decoding with ragged acceptance passes per-row `start` ([b]), per-slot `ctx_start` ([b, C]
        positions) and `key_valid` [b, cached + C + block_size] (False = a hole left by a row that accepted
        fewer tokens). ctx_ids [b, C]: the tokens at those positions (families that pair a feature with the next
        token's embedding read them). copy: (candidates [b, num_drafts], matched lengths [b], records [b, 2]) for
        drafters with a copy input (decoding/lookup.copy_inputs; None = no candidates); other drafters ignore it.
        noise [b, >= n, V]: added to the draft logits of positions start+1.. over the whole vocabulary before the
        drafter picks (Gumbel-coupled sampling, sampling.GumbelNoise; it then drafts greedily: temperature 0).
        """

    @torch.no_grad()
    def take_in(self, ctx_feats: torch.Tensor, ctx_start, anchor: torch.Tensor, start, cache,
                key_valid: torch.Tensor | None = None) -> None:
        """Append a context to the draft cache without keeping a draft (batched decoding's new rows, whose prompts
        are taken in by themselves rather than padded to the whole batch); arguments as for `draft`. This default
        drafts one token and drops it; families override it with their context pass alone."""
        self.draft(ctx_feats, ctx_start, anchor, start, cache, n=1, key_valid=key_valid)

    @abstractmethod
    def training_blocks(self, ctx_feats: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                        anchors: torch.Tensor, keep: torch.Tensor, prefix_mode: str = "teacher_forcing",
                        copy: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> BlockBatch:
        """Logits of the drafts after every anchor [b, N] in one forward (the target's features ctx_feats of the
        whole sequence given): what the training objective scores."""

    @abstractmethod
    def body_parts(self) -> dict[str, nn.Module]:
        """The family's modules by role, for parameter counts: {"backbone": ..., "head": ... (optional)}."""

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

    # ---- inference options -----------------------------------------------------------------------
    def set_options(self, options: InferenceOptions | None) -> "Drafter":
        if options is not None:
            self.options = options
        return self

    def set_head(self, impl: str | None = None, candidate_pool: int | None = None) -> "Drafter":
        """Choose the head's inference path (`fused`, `fast`, `compiled`, `eager`) and candidate pool (0 = full
        vocabulary); None keeps the current choice."""
        from dataclasses import replace

        kw = {k: v for k, v in (("head_impl", impl), ("candidate_pool", candidate_pool)) if v is not None}
        return self.set_options(replace(self.options, **kw))

    @property
    def uses_head(self) -> bool:
        return self.has_head and self.head_enabled

    # ---- FR-Spec (draft vocabulary restricted to frequent tokens) ---------------------------------------
    @property
    def draft_vocab(self) -> torch.Tensor | None:
        """Sorted vocabulary ids the drafter may propose (FR-Spec), or None = the whole vocabulary (no list, or
        the `full_vocab` inference option)."""
        return self.frspec_ids if self.config.frspec_k and not self.options.full_vocab else None

    def set_frspec(self, ids) -> "Drafter":
        """Install the FR-Spec token list (e.g. `frspec.frequent_tokens(rows, k)`); its length must be frspec_k."""
        ids = torch.as_tensor(list(ids), dtype=torch.long)
        k, v = self.config.frspec_k, self.config.vocab_size
        if not k:
            raise UserError("this drafter has frspec_k = 0; build it with frspec_k=K to restrict its vocabulary")
        if ids.numel() != k or ids.unique().numel() != k or int(ids.min()) < 0 or int(ids.max()) >= v:
            raise UserError(f"FR-Spec needs {k} distinct token ids in [0, {v}), got {ids.numel()}")
        self.frspec_ids.copy_(ids.sort().values.to(self.frspec_ids.device))
        return self

    def draft_head_rows(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, bias) of the draft LM head: the target's, or only its FR-Spec rows (the point of FR-Spec: the
        LM-head matmul of drafting shrinks from V to K rows)."""
        vm = self.draft_vocab
        lm = self.target.lm_head
        if vm is None:
            return lm.weight, getattr(lm, "bias", None)
        return self._fr_rows()[0]

    def _fr_rows(self):
        """((weight, bias) of the FR-Spec rows, the list's token ids as a set), rebuilt when either changes."""
        vm, lm = self.draft_vocab, self.target.lm_head
        bias = getattr(lm, "bias", None)
        key = (lm.weight.data_ptr(), lm.weight._version, vm.data_ptr(), vm._version, lm.weight.device)
        if self._fr_head is None or self._fr_head[0] != key:
            with torch.no_grad():
                self._fr_head = (key, (lm.weight[vm], bias[vm] if bias is not None else None), frozenset(vm.tolist()))
        return self._fr_head[1:]

    def draft_lm_head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of the draft vocabulary (draft_head_rows)."""
        return linear(h, *self.draft_head_rows())

    def unlisted(self, ids: torch.Tensor | None) -> torch.Tensor | None:
        """The distinct tokens of `ids` (-1 = none) that the FR-Spec list leaves out (None: no list or no ids)."""
        if self.draft_vocab is None or ids is None:
            return None
        # (a few copy candidates a block, b x n: on the host, a set lookup costs less than the ops that mask, sort
        # and index them, and draft_logits reads the count on the host anyway)
        members = self._fr_rows()[1]
        return torch.tensor(sorted({i for i in ids.flatten().tolist() if i >= 0 and i not in members}),
                            dtype=torch.long, device=ids.device)

    def draft_logits(self, h: torch.Tensor, extra_ids: torch.Tensor | None = None, base: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft logits of h [..., H] and the vocabulary ids of their columns (None = the whole vocabulary). An
        FR-Spec list is extended by the tokens `extra_ids` [m] (-1 = none) outside it (one more LM-head row each):
        tokens a drafter must be able to propose in this call although the frequency list leaves them out.
        `base`: the draft vocabulary's logits (draft_lm_head) when they are computed already."""
        base, vm = self.draft_lm_head(h) if base is None else base, self.draft_vocab
        extra = self.unlisted(extra_ids)
        if extra is None or not extra.numel():
            return base, vm
        lm = self.target.lm_head
        bias = getattr(lm, "bias", None)
        more = F.linear(h, lm.weight[extra], bias[extra] if bias is not None else None)
        return torch.cat([base, more], dim=-1), torch.cat([vm, extra])

    # ---- bookkeeping ---------------------------------------------------------------------------
    def param_counts(self) -> dict:
        parts = {k: sum(p.numel() for p in m.parameters()) for k, m in self.body_parts().items()}
        backbone, head = parts.get("backbone", 0), parts.get("head", 0)
        return {"backbone": backbone, "head": head, "total": sum(parts.values()),
                "head_over_backbone_pct": round(100.0 * head / backbone, 2) if backbone else 0.0}

    def save_pretrained(self, out_dir: str | os.PathLike, provenance: dict | None = None) -> Path:
        """config.json + model.safetensors, written to a temporary directory and swapped into place (errors.atomic_dir):
        a crash leaves the old drafter or the new one, never neither. `provenance` (JSON-able: what the drafter was
        trained on, e.g. the data's content digest) goes into the safetensors metadata; `read_provenance` reads it."""
        meta = {"format": "pt", "method": self.config.method}
        if provenance:
            meta["provenance"] = json.dumps(provenance, sort_keys=True)
        with atomic_dir(out_dir) as tmp:
            (tmp / "config.json").write_text(self.config.to_json())
            state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
            save_file(state, str(tmp / "model.safetensors"), metadata=meta)
        return Path(out_dir)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, target) -> "Drafter":
        path = Path(path)
        if str(path) in SHIPPED_DRAFTERS:
            path = SHIPPED_DRAFTERS[str(path)]
        from .export import is_release_dir, load_release

        if is_release_dir(path):     # a Domino / DFlash / speculators release layout (models/export.py)
            return load_release(path, target)
        cfg_file, weights = path / "config.json", path / "model.safetensors"
        if not cfg_file.exists() or not weights.exists():
            raise UserError(f"drafter '{path}' is not a drafter directory (needs config.json and model.safetensors); "
                            "pass a directory written by Drafter.save_pretrained / domino_lab.train")
        cfg = DrafterConfig.from_dict(read_config_json(cfg_file), source=str(cfg_file))
        cfg.check_target(target)
        drafter = Drafter(cfg)
        check_weights(weights, drafter.state_dict(), cfg_file)
        drafter.load_state_dict(load_file(str(weights)), strict=True)
        return drafter.bind(target)

    @classmethod
    def untrained(cls, target, method: str = "domino", seed: int = 0, **overrides) -> "Drafter":
        """A freshly initialised, seeded drafter for `target` (teaching, tests, `untrained:<method>`)."""
        torch.manual_seed(seed)
        return Drafter(DrafterConfig.for_target(target, method, **overrides), target)


def read_config_json(cfg_file: Path):
    """The parsed JSON of a drafter's config.json; an unreadable or non-JSON file is one UserError naming it."""
    fix = "restore the config.json that Drafter.save_pretrained / domino_lab.export wrote"
    try:
        return json.loads(cfg_file.read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"cannot read drafter config {cfg_file}: {e.strerror}; {fix}") from None
    except ValueError as e:       # not UTF-8, or not JSON
        raise UserError(f"drafter config {cfg_file} is not valid JSON ({e}); {fix}") from None


def read_provenance(path: str | os.PathLike) -> dict:
    """What `save_pretrained` recorded about a drafter directory (or shipped name)'s training, e.g.
    {"data_digest": ..., "target_digest": ..., "seed": ..., "step": ...}; {} when nothing was recorded (drafters
    saved before provenance was kept, release layouts)."""
    from safetensors import safe_open

    path = SHIPPED_DRAFTERS.get(str(path), Path(path))
    weights = Path(path) / "model.safetensors"
    if not weights.exists():
        return {}
    try:
        with safe_open(str(weights), "pt") as f:
            raw = (f.metadata() or {}).get("provenance")
        return json.loads(raw) if raw else {}
    except (OSError, ValueError, json.JSONDecodeError):
        return {}


def check_weights(weights: Path, expected: dict, cfg_file: Path) -> None:
    """The safetensors file holds exactly the tensors `expected` (a state dict) names, with their shapes, and is
    complete (read from its header, before any tensor is loaded): a truncated or corrupted file, or a config.json
    that disagrees with the weights, is one UserError instead of a loader traceback."""
    fix = "re-export the drafter (Drafter.save_pretrained / domino_lab.train) or restore its files"
    shapes = safetensors_shapes(weights, fix)
    want = {k: list(v.shape) for k, v in expected.items()}
    missing, extra = sorted(set(want) - set(shapes)), sorted(set(shapes) - set(want))
    if missing or extra:
        what = (f"lacks {missing[0]}" if missing else f"has {extra[0]}, which this architecture does not")
        raise UserError(f"drafter weights {weights} do not match {cfg_file.name}: the file {what}; {fix}")
    for k in want:
        if shapes[k] != want[k]:
            raise UserError(f"drafter weights {weights} do not match {cfg_file.name}: {k} is {shapes[k]} in the "
                            f"weights but {want[k]} for the config (intermediate_size, rank, num_layers, ... "
                            f"disagree with the weights); {fix}")


def load_drafter(spec: str | None, target, seed: int = 0, options: InferenceOptions | None = None
                 ) -> Drafter | None:
    """Resolve a drafter spec: 'none', 'untrained:METHOD[:key=value,...]' (e.g. `untrained:domino:block_size=16`),
    a shipped name, or a checkpoint dir; `options` says how to run it (default InferenceOptions())."""
    if spec is None or spec == "none":
        return None
    if not str(spec).strip():
        raise UserError("the drafter name is empty; pass a shipped name (default, default-dflash, ...), a drafter "
                        "directory, untrained:METHOD, or none")
    return _resolve_drafter(spec, target, seed).set_options(options)


def load_item(item, target, seed: int = 0) -> Drafter:
    """The drafter of a command-line item (`models.options.drafter_items`): run with the item's options, its Domino
    head off for `SPEC:head-off`."""
    d = load_drafter(item.path, target, seed=seed, options=item.options)
    if item.head_off:
        d.head_enabled = False
    return d


def family_of(spec: str) -> type | None:
    """The family class (models/registry.py) of a shipped name or checkpoint dir (ours or a release layout), read
    from its config.json without loading weights; None when it is not a readable drafter directory."""
    from .export import layout_of, method_of, read_config

    cfg = read_config(SHIPPED_DRAFTERS.get(spec, Path(spec)))
    if cfg is None:
        return None
    try:
        method = method_of(cfg) if layout_of(cfg) else cfg.get("method")
        return registry.family(method)
    except (UserError, TypeError, AttributeError):     # a field of the wrong type: not a drafter we can read
        return None


def _resolve_drafter(spec: str, target, seed: int) -> Drafter:
    if spec.startswith("untrained:"):
        import yaml

        _, method, *rest = spec.split(":", 2)
        overrides = {}
        # commas separate the pairs, except inside a list value (target_layer_ids=[1,3])
        for item in filter(None, re.split(r",(?![^\[\]]*\])", rest[0] if rest else "")):
            if "=" not in item:
                raise UserError(f"drafter '{spec}': '{item}' must look like key=value "
                                "(e.g. untrained:domino:block_size=16)")
            k, v = item.split("=", 1)
            try:
                value = yaml.safe_load(v)
            except yaml.YAMLError:
                raise UserError(f"drafter '{spec}': the value of {k.strip()} ({v!r}) is not a number, word or "
                                "[list]") from None
            if isinstance(value, str):          # YAML reads 1e-5 (no dot) as a string
                try:
                    value = float(value)
                except ValueError:
                    pass
            overrides[k.strip()] = value
        return Drafter.untrained(target, method, seed=seed, **overrides)
    if spec in SHIPPED_DRAFTERS and not (SHIPPED_DRAFTERS[spec] / "config.json").exists():
        raise UserError(f"the shipped drafter '{spec}' is not in this install; train one with "
                        "`python -m domino_lab.train` or use 'untrained:domino' / a checkpoint directory")
    return Drafter.from_pretrained(spec, target)
