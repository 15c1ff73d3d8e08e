"""DrafterConfig: the drafter's architecture, every knob typed in one place; it is what a checkpoint saves.

How a drafter is *run* (head implementation, candidate pool, block-size cap) is `InferenceOptions`
(models/options.py), chosen per call and never saved."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING

from ..errors import UserError

if TYPE_CHECKING:
    from ..target import Target

# Keys older checkpoints wrote into config.json that are inference options now: read and ignored.
RUNTIME_KEYS = ("head_impl", "candidate_pool")


_SCALARS = {"int": int, "float": float, "bool": bool, "str": str}   # annotations are strings here


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)     # JSON true is not a layer id or a size


@dataclass
class DrafterConfig:
    method: str = "domino"            # a registered family (models/registry.py): "dflash" = backbone only;
    #                                   "domino" = backbone + Domino head (models/block.py); "eagle" = EAGLE-3-style
    #                                   autoregressive chain (models/eagle.py)
    # Backbone (Qwen3-style decoder layers with the target's width; docs/design.md#the-parallel-backbone).
    hidden_size: int = 256
    num_layers: int = 1
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 4096
    vocab_size: int = 8192
    target_layer_ids: list[int] = field(default_factory=lambda: [1])
    block_size: int = 8               # B: slots per block, [anchor, MASK x (B-1)]
    mask_token_id: int = 0
    # shift_label=True (Domino release): slot k predicts x_{a+k+1}, B drafts per block.
    # shift_label=False (DFlash paper): slot k predicts x_{a+k}, slot 0 is the anchor, B-1 drafts.
    shift_label: bool = True
    # anchor_feature=True: the fused target feature of the position just before the anchor (the state that predicted
    # the anchor) is also added, through a learned projection, to every block slot's input, so it enters the
    # residual stream as in an EAGLE-style chain instead of arriving only through attention over the context
    # (docs/design.md#the-first-draft-gap). Not part of the DFlash/Domino release layouts.
    anchor_feature: bool = False
    # Copy input (block drafters; 0 = off): each slot also reads the token that copying the text would draft there
    # (the continuation of the latest earlier occurrence of the text's last >= copy_ngram tokens) and the matched
    # length, so the drafter learns when to copy and when to predict (docs/design.md#copy-input).
    copy_ngram: int = 0
    # Domino head (ignored for dflash).
    gru_hidden: int = 256             # g
    rank: int = 64                    # r
    # correct_first=True: the head also corrects draft 0, from H_0 and the GRU state after the anchor alone
    # (docs/design.md#correcting-the-first-draft). Off in the paper's head and the release layouts.
    correct_first: bool = False
    # FR-Spec: draft only among the K most frequent tokens of the training data (0 = off). The ids live in the
    # checkpoint (buffer `frspec_ids`); base logits (and Domino's W2) are scored on them only, drafts are mapped
    # back to vocabulary ids for verification. See Drafter.set_frspec / domino_lab.models.frspec.
    frspec_k: int = 0
    # What the drafter was built for; checked on load.
    target_fingerprint: dict = field(default_factory=dict)

    def __post_init__(self):
        from .registry import family

        self._check_field_types()
        family(self.method).check_config(self)     # unknown methods and family-specific rules
        if self.block_size < 1 or (not self.shift_label and self.block_size < 2):
            raise UserError(f"block_size {self.block_size} is too small (needs >= {1 if self.shift_label else 2})")
        if self.block_size >= self.max_position_embeddings:
            raise UserError(f"block_size {self.block_size} must be smaller than the context of "
                            f"{self.max_position_embeddings} positions (a block and its anchor sit in it)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError("num_attention_heads must be a multiple of num_key_value_heads")
        if not 0 <= self.frspec_k <= self.vocab_size:
            raise UserError(f"frspec_k must be in [0, vocab_size={self.vocab_size}] (0 = off), got {self.frspec_k}")
        if not 0 <= self.copy_ngram <= 16:
            raise UserError(f"copy_ngram must be in [0, 16] (0 = no copy input), got {self.copy_ngram}")
        if self.correct_first and self.method != "domino":
            raise UserError(f"correct_first is an option of the Domino head (method domino); method {self.method!r} "
                            "has no head: drop correct_first or use method domino")
        for name in ("num_layers", "gru_hidden", "rank", "head_dim"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be >= 1 (got {getattr(self, name)})")
        # token ids index the target's embedding: one outside the vocabulary fails only mid-decode
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise UserError(f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size}); "
                            "use the target's MASK token id")
        if not self.target_layer_ids or min(self.target_layer_ids) < 0:
            raise UserError(f"target_layer_ids {self.target_layer_ids} must name at least one target layer, "
                            "each >= 0")

    def _check_field_types(self) -> None:
        """Every field holds its annotated type (an int where a float is expected becomes that float): values
        from `untrained:METHOD:key=value` specs or hand-edited config files arrive unchecked, and a wrong one
        would otherwise fail far from here, mid-load or mid-decode."""
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type == "list[int]":
                if not isinstance(v, list) or not all(_is_int(x) for x in v):
                    raise UserError(f"drafter option {f.name} must be a list of ints, got {v!r}")
                continue
            if f.type == "dict":
                if not isinstance(v, dict):
                    raise UserError(f"drafter option {f.name} must be a JSON object (a dict), got {v!r}")
                continue
            want = _SCALARS.get(f.type)
            if want is None:
                continue
            if want is float and _is_int(v):
                setattr(self, f.name, float(v))
            elif (want is int and not _is_int(v)) or not isinstance(v, want):
                raise UserError(f"drafter option {f.name} must be {'a' if want is not int else 'an'} "
                                f"{want.__name__}, got {v!r}")

    @property
    def num_drafts(self) -> int:
        """Draft tokens per block (eagle: the length of its chain, the same budget as a block)."""
        return self.block_size if self.shift_label else self.block_size - 1

    @property
    def first_draft_slot(self) -> int:
        """Block slot whose hidden state predicts the first draft token."""
        return 0 if self.shift_label else 1

    @classmethod
    def for_target(cls, target: "Target", method: str = "domino", **overrides) -> "DrafterConfig":
        """A drafter shaped like `target` (width, heads, rope), with small defaults for the rest."""
        tc = target.model.config
        if target.mask_token_id is None:
            raise UserError(f"target '{target.name}' has no reserved MASK token (no '<|mask|>' in its tokenizer "
                            "and no unused embedding row); pass mask_token_id explicitly")
        heads = getattr(tc, "num_attention_heads", 4)
        rope = getattr(tc, "rope_parameters", None) or {}
        base = dict(
            method=method,
            hidden_size=target.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
            head_dim=getattr(tc, "head_dim", None) or target.hidden_size // heads,
            intermediate_size=getattr(tc, "intermediate_size", 4 * target.hidden_size),
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", getattr(tc, "rope_theta", 1e6))),
            max_position_embeddings=target.max_length,
            vocab_size=target.vocab_size,
            target_layer_ids=list(target.taps),
            mask_token_id=target.mask_token_id,
            gru_hidden=min(256, 2 * target.hidden_size),
            rank=min(64, target.hidden_size),
            target_fingerprint=target.fingerprint,
        )
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise UserError(f"unknown drafter option(s) {sorted(unknown)}")
        base.update(overrides)
        return cls(**base)

    def check_target(self, target: "Target") -> None:
        # a drafter's layers run at the target's hidden width on the target's own embedding and LM head; a target that
        # projects between a narrower embedding and its layers (OPT-350m's word_embed_proj_dim) has no such width
        widths = {target.embed_tokens.weight.shape[-1], target.lm_head.weight.shape[-1]} - {target.hidden_size}
        if widths:
            raise UserError(f"target '{target.name}' embeds tokens {widths.pop()} wide but its layers are "
                            f"{target.hidden_size} wide (a projection between them, as OPT-350m has), and a drafter "
                            "runs at the layers' width on the target's embedding and LM head: decode this target "
                            "without a drafter")
        fp, saved = target.fingerprint, self.target_fingerprint
        # drafters saved before fingerprints named the model type (the shipped ones among them) are checked on the rest
        diff = {k: (saved.get(k), fp[k]) for k in fp if saved.get(k) != fp[k] and (k in saved or k != "model_type")}
        if saved and diff:
            raise UserError("drafter does not fit this target: " + ", ".join(
                f"{k} drafter={a} target={b}" for k, (a, b) in diff.items()) +
                "; use a drafter trained for this target")
        if self.hidden_size != target.hidden_size or self.vocab_size != target.vocab_size:
            raise UserError(f"drafter does not fit this target: hidden {self.hidden_size} vs {target.hidden_size}, "
                            f"vocab {self.vocab_size} vs {target.vocab_size}")
        if max(self.target_layer_ids) >= target.num_layers:
            raise UserError(f"drafter taps layers {self.target_layer_ids} but the target has {target.num_layers}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_dict(cls, d: dict, source: str | None = None) -> "DrafterConfig":
        """The config a JSON object describes; `source` (the file it came from) is named in every error."""
        where = f"drafter config {source}" if source else "drafter config"
        if not isinstance(d, dict):
            raise UserError(f"{where} must be a JSON object of drafter options, got a {type(d).__name__}; "
                            "restore the config.json that Drafter.save_pretrained / domino_lab.export wrote")
        known = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k not in RUNTIME_KEYS}
        unknown = set(d) - known
        if unknown:
            raise UserError(f"{where} has unknown key(s) {sorted(unknown)}")
        try:
            return cls(**d)
        except UserError as e:
            if not source:
                raise
            raise UserError(f"{where}: {e}") from None
