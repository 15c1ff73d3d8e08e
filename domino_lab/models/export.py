"""Checkpoint interop with the public Domino and DFlash releases: write a drafter in their layout, read theirs.

Every layout is a directory with `config.json` + `model.safetensors` and no embedding or LM head of its own
(except `speculators`, see below); the drafter borrows the target's, as here.

- `domino` (the Domino release, its SGLang branch, SpecForge): a Qwen3 config (`model_type: qwen3`,
  `architectures: ["DFlashDraftModel"]`, `num_hidden_layers` = draft layers) plus `block_size`,
  `num_target_layers` and `dflash_config` = {mask_token_id, target_layer_ids, projector_type "domino",
  emb_dim (r), gru_hidden_dim (g), shift_label, pure_draft_prefix_len 1}; `emb_dim` is repeated at the top level,
  where SGLang reads it. `pure_draft_prefix_len = 1` is this project's rule that the first draft is uncorrected.
- `dflash` (the DFlash release): the same config without a projector. Its decoding loop drafts from block slots
  1..B-1 (slot 0 is the anchor), so only `shift_label = False` drafters have this layout.
- `speculators` (vLLM's speculators format): `speculators_model_type` dflash / domino, the Qwen3 config under
  `transformer_layer_config`, the taps as `aux_hidden_state_layer_ids` = target_layer_ids + 1 (vLLM counts the
  embedding output as layer 0), `sample_from_anchor` = shift_label, the head under `logits_correction.*`, and
  the target's embedding and LM head saved in the checkpoint (`embed_tokens.weight`, `lm_head.weight`).

Tensor names, release = ours: `fc`, `hidden_norm`, `norm`, `layers.{i}.*` = `backbone.*` (same sub-names);
`prefix_gru.weight_{ih,hh}_l0` = `head.gru.*` (bias-free, PyTorch gate order r, z, n);
`embed_proj.0.weight` = `head.w1.weight` ([r, H+g], input [h ; s]); `embed_proj.2.weight` = `head.w2.weight` ([V, r]).
Reading also accepts the head under `logit_head.*` or `logits_correction.*`, a leading `model.`, and ignores the
target tensors a checkpoint may carry (embed_tokens, lm_head, verifier_*).

The arithmetic is the same on both sides (docs/design.md#backbone, #domino-head): taps are raw
`hidden_states[j+1]`, concatenated -> fc -> RMSNorm; block slot s at absolute position anchor+s, context t at t
(RoPE on both); the block attends to every cached context position (all strictly before the anchor) and to all
of its own slots; draft i >= 1 of a Domino block is argmax(lm_head(h_i) + W2 SiLU(W1 [h_i ; S_i])) with S_i the
zero-started GRU state after the embeddings of [anchor, d_0, ..., d_{i-1}].
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from ..errors import UserError, atomic_dir
from . import registry
from .config import DrafterConfig

FORMATS = ("domino", "dflash", "speculators")
RELEASE_ARCHS = ("DFlashDraftModel", "DominoDraftModel")
DOMINO_PROJECTORS = ("domino", "causal_v5")       # causal_v5: the name of the same head in early checkpoints
SPECULATORS_TYPES = ("dflash", "domino")
# speculators' own defaults where its config leaves a field out
SPECULATORS_DEFAULTS = {"gru_hidden_dim": 1024, "logits_correction_emb_dim": 256, "pure_draft_prefix_len": 1}

HEAD_TO_RELEASE = {"head.gru.weight_ih_l0": "prefix_gru.weight_ih_l0",
                   "head.gru.weight_hh_l0": "prefix_gru.weight_hh_l0",
                   "head.w1.weight": "embed_proj.0.weight",
                   "head.w2.weight": "embed_proj.2.weight"}
RELEASE_TO_HEAD = {v: k for k, v in HEAD_TO_RELEASE.items()}
HEAD_ALIASES = ("logits_correction.", "logit_head.")
TARGET_TENSORS = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight",
                  "t2d", "d2t", "rotary_emb.inv_freq")
_BACKBONE_KEY = re.compile(r"^(fc\.weight|hidden_norm\.weight|norm\.weight|layers\.\d+\.(self_attn\.(q|k|v|o)_proj"
                           r"|self_attn\.(q|k)_norm|mlp\.(gate|up|down)_proj|input_layernorm"
                           r"|post_attention_layernorm)\.weight)$")


# ---- recognising a release directory --------------------------------------------------------------
def read_config(path: str | os.PathLike) -> dict | None:
    """config.json of a directory as a dict, or None when there is none / it is not JSON."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def layout_of(cfg: dict | None) -> str | None:
    """'release' (Domino / DFlash), 'speculators', or None (this project's own layout, or not a drafter)."""
    if not isinstance(cfg, dict) or "method" in cfg:
        return None
    if cfg.get("speculators_model_type") in SPECULATORS_TYPES:
        return "speculators"
    archs = cfg.get("architectures") or []
    if isinstance(cfg.get("dflash_config"), dict) or any(a in RELEASE_ARCHS for a in archs):
        return "release"
    return None


def is_release_dir(path: str | os.PathLike) -> bool:
    return layout_of(read_config(path)) is not None


def method_of(cfg: dict) -> str:
    """The registered method a release config corresponds to ('dflash' or 'domino')."""
    layout = layout_of(cfg)
    if layout == "speculators":
        return cfg["speculators_model_type"]
    if layout is None:
        raise UserError("not a Domino/DFlash release config (no dflash_config, no DFlashDraftModel architecture)")
    archs = cfg.get("architectures") or []
    if archs and not any(a in RELEASE_ARCHS for a in archs):
        raise UserError(f"draft architecture {archs} is not one this project can load; it reads "
                        f"{list(RELEASE_ARCHS)} (Qwen3-style DFlash / Domino drafters)")
    projector = (cfg.get("dflash_config") or {}).get("projector_type")
    if projector is None:
        return "domino" if "DominoDraftModel" in archs else "dflash"
    if projector in DOMINO_PROJECTORS:
        return "domino"
    raise UserError(f"projector_type '{projector}' has no counterpart here; this project reads drafters without "
                    f"a projector (DFlash) or with {list(DOMINO_PROJECTORS)} (the Domino head)")


def release_default_taps(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The releases' default taps when a config lists none: one draft layer -> the middle target layer; k draft
    layers -> k ids spread from 1 to L-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    lo, hi = 1, num_target_layers - 3
    return [int(round(lo + i * (hi - lo) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


# ---- writing -------------------------------------------------------------------------------------
def check_exportable(cfg: DrafterConfig, fmt: str) -> None:
    """Refuse, with one clear line, what `fmt` cannot represent."""
    if fmt not in FORMATS:
        raise UserError(f"unknown export format '{fmt}'; use one of {list(FORMATS)}")
    if cfg.method not in ("dflash", "domino"):
        raise UserError(f"a '{cfg.method}' drafter has no counterpart in the Domino / DFlash / speculators layouts "
                        "(they hold block drafters only); export a dflash or domino drafter")
    if cfg.anchor_feature:
        raise UserError("this drafter adds the state before the anchor to its block inputs (anchor_feature=true); "
                        "the release layouts have no such projection. Export a drafter trained without it")
    if cfg.method == "domino" and cfg.correct_first:
        raise UserError("this drafter's head also corrects draft 0 (correct_first=true); the Domino release layout "
                        "leaves draft 0 uncorrected. Export a drafter trained without it")
    if cfg.copy_ngram:
        raise UserError(f"this drafter reads copy candidates in its block inputs (copy_ngram={cfg.copy_ngram}); the "
                        "release layouts have no copy input. Export a drafter trained with copy_ngram 0 (shipped: "
                        "default-nocopy, default-dflash-nocopy)")
    if fmt == "domino" and cfg.method != "domino":
        raise UserError("--format domino holds a Domino head and this is a dflash drafter; "
                        "use --format dflash (shift_label=False drafters) or --format speculators")
    if fmt == "dflash" and cfg.method != "dflash":
        raise UserError("--format dflash has no place for the Domino head; use --format domino or speculators "
                        "(or export a dflash drafter)")
    if fmt == "dflash" and cfg.shift_label:
        raise UserError("the DFlash release drafts from block slots 1..B-1 (shift_label=False) and this drafter "
                        "was trained with shift_label=True (slot 0 drafts too); use --format speculators, which "
                        "records it as sample_from_anchor=true")


def _qwen3_fields(cfg: DrafterConfig, dtype: torch.dtype) -> dict:
    n = cfg.num_layers
    dtype_name = str(dtype).removeprefix("torch.")
    return {"model_type": "qwen3", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": n, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
            "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": None,
            "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
            "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": n,
            "layer_types": ["full_attention"] * n, "initializer_range": 0.02,
            "dtype": dtype_name, "torch_dtype": dtype_name}


def _num_target_layers(drafter) -> int:
    n = (drafter.config.target_fingerprint or {}).get("num_layers")
    if n is None and drafter._target is not None:
        n = drafter.target.num_layers
    if n is None:
        raise UserError("the drafter records no target layer count (target_fingerprint) and is not bound to a "
                        "target; load it with its target before exporting")
    return int(n)


def release_config(drafter, fmt: str, dtype: torch.dtype, verifier: str | None = None) -> dict:
    """config.json of `drafter` in layout `fmt` (checked with check_exportable first)."""
    cfg = drafter.config
    check_exportable(cfg, fmt)
    qwen3 = _qwen3_fields(cfg, dtype)
    taps = list(cfg.target_layer_ids)
    domino = cfg.method == "domino"
    if fmt == "speculators":
        target = drafter._target
        out = {"speculators_model_type": cfg.method,
               "architectures": ["DominoSpeculator" if domino else "DFlashSpeculator"],
               "transformer_layer_config": qwen3, "draft_vocab_size": cfg.vocab_size, "block_size": cfg.block_size,
               "aux_hidden_state_layer_ids": [t + 1 for t in taps], "mask_token_id": cfg.mask_token_id,
               "sample_from_anchor": cfg.shift_label}
        if domino:
            out |= {"gru_hidden_dim": cfg.gru_hidden, "logits_correction_emb_dim": cfg.rank,
                    "pure_draft_prefix_len": 1}
        archs = list(getattr(target.model.config, "architectures", None) or []) if target is not None else []
        out["speculators_config"] = {
            "algorithm": cfg.method,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.num_drafts,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier or (target.name if target is not None else None),
                         "architectures": archs}}
        out |= {"dtype": qwen3["dtype"], "torch_dtype": qwen3["torch_dtype"]}
        return out
    dflash_config = {"mask_token_id": cfg.mask_token_id, "target_layer_ids": taps, "shift_label": cfg.shift_label}
    out = {"architectures": ["DFlashDraftModel"], **qwen3, "block_size": cfg.block_size,
           "num_target_layers": _num_target_layers(drafter)}
    if domino:
        dflash_config |= {"projector_type": "domino", "emb_dim": cfg.rank, "gru_hidden_dim": cfg.gru_hidden,
                          "pure_draft_prefix_len": 1}
        out = {"emb_dim": cfg.rank, **out, "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}}
    out["dflash_config"] = dflash_config
    return out


def release_state_dict(drafter, fmt: str, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The drafter's tensors under the layout's names (speculators: plus the target's embedding and LM head)."""
    check_exportable(drafter.config, fmt)
    head_prefix = "logits_correction." if fmt == "speculators" else ""
    out = {}
    for k, v in drafter.state_dict().items():
        if k == "frspec_ids":
            # FR-Spec only restricts drafting; the weights score the whole vocabulary, as the layouts do, so the
            # export is the drafter over its full vocabulary (the token list is not part of any layout)
            continue
        if k.startswith("backbone."):
            name = k[len("backbone."):]
        elif k in HEAD_TO_RELEASE:
            name = head_prefix + HEAD_TO_RELEASE[k]
        else:
            raise RuntimeError(f"no release name for drafter tensor '{k}'")
        out[name] = v
    if fmt == "speculators":
        if drafter._target is None:
            raise UserError("the speculators layout stores the target's embedding and LM head; bind the drafter "
                            "to its target first")
        out["embed_tokens.weight"] = drafter.target.embed_tokens.weight
        out["lm_head.weight"] = drafter.target.lm_head.weight
    dtype = dtype or next(iter(out.values())).dtype
    # clone: a tied target (embedding = LM head) must not hand safetensors two views of one storage
    return {k: v.detach().to("cpu", dtype).contiguous().clone() for k, v in out.items()}


def export_drafter(drafter, fmt: str, out_dir: str | os.PathLike, dtype: torch.dtype | None = None,
                   verifier: str | None = None) -> Path:
    """Write config.json + model.safetensors + README.md of `drafter` in layout `fmt` to out_dir, atomically
    (a previous export there is replaced; any other non-empty directory is refused)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    check_exportable(drafter.config, fmt)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not is_release_dir(out))):
        raise UserError(f"{out} exists and is not an earlier export; choose a new or empty --out directory")
    state = release_state_dict(drafter, fmt, dtype)
    cfg = release_config(drafter, fmt, next(iter(state.values())).dtype, verifier)
    with atomic_dir(out) as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "README.md").write_text(serving_readme(drafter, fmt, out, cfg))
    return out


def frspec_note(cfg: DrafterConfig) -> str:
    """What an export does to a drafter with an FR-Spec list (none of the layouts can hold one), for its README and
    the export command's output."""
    return (f"It drafted over an FR-Spec list of its {cfg.frspec_k} most frequent tokens here; no layout holds that "
            f"list, so the export drafts over all {cfg.vocab_size} tokens, as the same drafter does here with "
            "`--full-vocab` (its τ can differ a little from the listed drafter's).")


def serving_readme(drafter, fmt: str, out: Path, cfg: dict) -> str:
    c = drafter.config
    target = drafter.target.name if drafter._target is not None else "<target>"
    b, n = c.block_size, c.num_drafts
    layers = (c.target_fingerprint or {}).get("num_layers", "?")
    own = ("It also carries the target's embedding and LM head (the speculators layout wants them)."
           if fmt == "speculators" else "No embedding or LM head of its own: the serving engine takes the target's.")
    if c.frspec_k:
        own += f" {frspec_note(c)}"
    head = f"# {c.method} drafter, {fmt} layout\n\nExported by `python -m domino_lab.export` for target `{target}` " \
           f"(hidden {c.hidden_size}, vocab {c.vocab_size}, {layers} layers); block size {b}, {n} drafts per " \
           f"block, taps {list(c.target_layer_ids)} (hidden_states[id + 1]), mask token {c.mask_token_id}. " \
           f"{own}\n\nThe commands below follow the engines' public documentation; they were not run for this " \
           "export (no GPU where it was made). Replace TARGET with the target's Hugging Face id or directory and " \
           "DIR with this directory.\n\n"
    if fmt == "domino":
        body = ("## SGLang (the Domino branch `sglang-feat/dflash-domino` of the Domino release repository)\n\n"
                "```bash\npython -m sglang.launch_server --model-path TARGET --speculative-algorithm DFLASH \\\n"
                f"    --speculative-draft-model-path {out} --speculative-num-draft-tokens {b}\n```\n\n"
                "## Transformers (the Domino release's modeling code)\n\nCopy the release's `dflash.py` (and the "
                "`accelerator.py` it imports) into this directory, then:\n\n```python\nfrom transformers import "
                "AutoModel\ndraft = AutoModel.from_pretrained(DIR, trust_remote_code=True, dtype=\"auto\")\n"
                "out = draft.spec_generate(input_ids=ids, target=target_model, max_new_tokens=256, temperature=0.0)"
                "\n```\n")
    elif fmt == "dflash":
        body = ("## SGLang (DFlash support: `--speculative-algorithm DFLASH`)\n\n```bash\npython -m "
                "sglang.launch_server --model-path TARGET --speculative-algorithm DFLASH \\\n"
                f"    --speculative-draft-model-path {out} --speculative-num-draft-tokens {b}\n```\n\n"
                "## vLLM (DFlash support: speculative method `dflash`)\n\n```bash\nvllm serve TARGET "
                f"--speculative-config '{{\"method\": \"dflash\", \"model\": \"{out}\", "
                f"\"num_speculative_tokens\": {n}}}'\n```\n\n"
                "## Transformers (the DFlash release's `dflash` package)\n\n```python\nfrom dflash.model import "
                "DFlashDraftModel, dflash_generate\ndraft = DFlashDraftModel.from_pretrained(DIR)\n```\n")
    else:
        body = ("## vLLM (a build that reads speculators checkpoints"
                + (" and has the Domino head" if c.method == "domino" else " with DFlash") + ")\n\n"
                f"```bash\nvllm serve {out}\n```\n\nThe verifier is read from `speculators_config.verifier."
                "name_or_path` (set it to the target's Hugging Face id if it is not one). "
                + ("`sample_from_anchor` is true: every block slot drafts, as this drafter was trained.\n"
                   if c.shift_label else "\n"))
    return head + body


# ---- reading -------------------------------------------------------------------------------------
def _load_weights(path: Path) -> dict[str, torch.Tensor]:
    single = path / "model.safetensors"
    if single.is_file():
        return _load_complete(single)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weights = {}
        for f in _shard_files(index):
            weights.update(_load_complete(path / f))
        return weights
    raise UserError(f"drafter '{path}' has a release config.json but no model.safetensors")


def _load_complete(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file, checked whole from its header first: a cut-off or corrupted download
    is one UserError naming the file, not a loader traceback."""
    from safetensors.torch import load_file

    from .weights_file import safetensors_shapes

    safetensors_shapes(file, "download the release again or restore its files")
    return load_file(str(file))


def _shard_files(index: Path) -> list[str]:
    """The weight files a sharded release's model.safetensors.index.json lists."""
    try:
        files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    except OSError as e:
        raise UserError(f"cannot read {index}: {e.strerror}; restore the release's files") from None
    except (ValueError, KeyError, TypeError, AttributeError):
        raise UserError(f"{index} is not a safetensors index (a JSON object with a weight_map of tensor -> file); "
                        "download the release again or restore its files") from None
    if not all(isinstance(f, str) for f in files):
        raise UserError(f"{index} maps tensors to something other than file names; restore the release's files")
    return files


def _qwen3(q: dict):
    """The draft layers' Qwen3 config, fields a config leaves out taking Qwen3Config's defaults: the release code
    builds its model from Qwen3Config too, and speculators saves only the fields that differ from them."""
    from transformers import Qwen3Config

    if q.get("model_type", "qwen3") != "qwen3":
        raise UserError(f"draft layers of model_type '{q.get('model_type')}' are not supported; this project's "
                        "draft layers are Qwen3-style (model_type qwen3)")
    fields = {k: v for k, v in q.items() if k not in ("model_type", "architectures", "auto_map", "transformers_version")}
    try:
        return Qwen3Config(**fields)
    except (TypeError, ValueError, KeyError) as e:
        raise UserError(f"the draft layers' Qwen3 config is invalid: {e}") from None


def _rope_theta(c) -> float:
    rope = dict(getattr(c, "rope_parameters", None) or {})
    for r in (rope, getattr(c, "rope_scaling", None) or {}):
        kind = r.get("rope_type", r.get("type", "default"))
        if kind not in (None, "default"):
            raise UserError(f"RoPE scaling '{kind}' is not supported by this project's draft layers "
                            "(plain RoPE only)")
    theta = rope.get("rope_theta", getattr(c, "rope_theta", None))
    return float(theta if theta is not None else 10000.0)


def release_to_config(cfg: dict, target, weights: dict[str, torch.Tensor] | None = None) -> DrafterConfig:
    """The DrafterConfig of a release / speculators config for `target`; refuses what does not fit it."""
    layout = layout_of(cfg)
    method = method_of(cfg)
    weights = weights or {}
    if layout == "speculators":
        q = _qwen3(cfg.get("transformer_layer_config") or {})
        aux = cfg.get("aux_hidden_state_layer_ids")
        if not aux:
            raise UserError("speculators config has no aux_hidden_state_layer_ids; this project needs the taps")
        taps = [int(i) - 1 for i in aux]
        block_size = cfg.get("block_size")
        mask = cfg.get("mask_token_id")
        shift = bool(cfg.get("sample_from_anchor", method == "domino"))
        g = cfg.get("gru_hidden_dim", SPECULATORS_DEFAULTS["gru_hidden_dim"])
        r = cfg.get("logits_correction_emb_dim", SPECULATORS_DEFAULTS["logits_correction_emb_dim"])
        prefix = cfg.get("pure_draft_prefix_len", SPECULATORS_DEFAULTS["pure_draft_prefix_len"])
        n_target = None
        draft_vocab = cfg.get("draft_vocab_size")
        if draft_vocab is not None and draft_vocab != q.vocab_size:
            raise UserError(f"speculators drafter has a draft vocabulary of {draft_vocab} tokens mapped onto the "
                            "target's; this project drafts over the whole vocabulary")
    else:
        q = _qwen3({k: v for k, v in cfg.items() if k not in ("dflash_config", "block_size", "num_target_layers",
                                                               "emb_dim", "target_layer_ids")})
        d = cfg.get("dflash_config") or {}
        block_size = d.get("block_size", cfg.get("block_size"))
        n_target = d.get("num_target_layers", cfg.get("num_target_layers"))
        taps = d.get("target_layer_ids", cfg.get("target_layer_ids"))
        if taps is None:
            taps = release_default_taps(int(n_target or target.num_layers), int(q.num_hidden_layers))
        mask = d.get("mask_token_id")
        if mask is None and d.get("mask_token") and target.tokenizer is not None:
            mask = target.tokenizer.convert_tokens_to_ids(d["mask_token"])
        shift = bool(d.get("shift_label", False))
        g = d.get("gru_hidden_dim")
        r = d.get("emb_dim", cfg.get("emb_dim"))
        prefix = d.get("pure_draft_prefix_len", 0)

    if q.hidden_act != "silu":
        raise UserError(f"draft MLP activation '{q.hidden_act}' is not supported (silu only)")
    if getattr(q, "attention_bias", False):
        raise UserError("draft attention with biases (attention_bias=true) is not supported")
    if getattr(q, "use_sliding_window", False) or any(t != "full_attention" for t in q.layer_types or []):
        raise UserError("sliding-window draft layers are not supported (full attention only)")
    if block_size is None:
        raise UserError("release config has no block_size (top level or dflash_config)")
    rope_theta = _rope_theta(q)

    hidden, vocab = int(q.hidden_size), int(q.vocab_size)
    if hidden != target.hidden_size or vocab != target.vocab_size:
        raise UserError(f"drafter does not fit this target: hidden {hidden} vs {target.hidden_size}, "
                        f"vocab {vocab} vs {target.vocab_size}; use a drafter released for this target")
    if n_target is not None and int(n_target) != target.num_layers:
        raise UserError(f"drafter was built for a target with {n_target} layers, this target has "
                        f"{target.num_layers}; use a drafter released for this target")
    taps = [int(t) for t in taps]
    if not taps or min(taps) < 0 or max(taps) >= target.num_layers:
        raise UserError(f"drafter taps layers {taps} but the target has {target.num_layers} (ids must be in "
                        f"[0, {target.num_layers}))")
    if mask is None:
        mask = target.mask_token_id
        if mask is None:
            raise UserError("release config has no dflash_config.mask_token_id and the target has no reserved "
                            "MASK token; add mask_token_id to the config")
    if method == "domino":
        if int(prefix) != 1:
            raise UserError(f"pure_draft_prefix_len={prefix}: this project's Domino head leaves exactly the first "
                            "draft of a block uncorrected (pure_draft_prefix_len=1)")
        hh = _find(weights, "prefix_gru.weight_hh_l0")
        w1 = _find(weights, "embed_proj.0.weight")
        g = g if g is not None else (hh.shape[1] if hh is not None else None)
        r = r if r is not None else (w1.shape[0] if w1 is not None else None)
        if g is None or r is None:
            raise UserError("Domino config lacks gru_hidden_dim / emb_dim and the weights do not show them")

    heads = int(q.num_attention_heads)
    extra = {"gru_hidden": int(g), "rank": int(r)} if method == "domino" else {}
    return DrafterConfig(
        method=method, hidden_size=hidden, num_layers=int(q.num_hidden_layers), num_attention_heads=heads,
        num_key_value_heads=int(q.num_key_value_heads or heads), head_dim=int(q.head_dim or hidden // heads),
        intermediate_size=int(q.intermediate_size), rms_norm_eps=float(q.rms_norm_eps), rope_theta=rope_theta,
        max_position_embeddings=int(q.max_position_embeddings or target.max_length), vocab_size=vocab,
        target_layer_ids=taps, block_size=int(block_size), mask_token_id=int(mask), shift_label=shift,
        target_fingerprint={"vocab_size": vocab, "hidden_size": hidden, "num_layers": target.num_layers}, **extra)


def _canonical(key: str) -> str:
    """A release tensor name without a leading `model.` and with the head under its bare names."""
    if key.startswith("model."):
        key = key[len("model."):]
    for alias in HEAD_ALIASES:
        if key.startswith(alias):
            return key[len(alias):]
    return key


def _find(weights: dict, name: str) -> torch.Tensor | None:
    for k, v in weights.items():
        if _canonical(k) == name:
            return v
    return None


def release_to_state_dict(weights: dict[str, torch.Tensor], cfg: DrafterConfig) -> dict[str, torch.Tensor]:
    """Release tensor names -> this project's; refuses tensors it has no place for and missing ones."""
    out, unknown = {}, []
    for k, v in weights.items():
        name = _canonical(k)
        if name in TARGET_TENSORS:
            continue
        if _BACKBONE_KEY.match(name):
            out["backbone." + name] = v
        elif name in RELEASE_TO_HEAD and cfg.method == "domino":
            out[RELEASE_TO_HEAD[name]] = v
        else:
            unknown.append(k)
    if unknown:
        raise UserError(f"release checkpoint has tensors this project's {cfg.method} drafter has no place for: "
                        f"{sorted(unknown)[:6]}{' ...' if len(unknown) > 6 else ''}")
    return out


def _config_of(cfg_file: Path, cfg: dict, target, weights: dict[str, torch.Tensor]) -> DrafterConfig:
    """release_to_config, with every error naming the file: a hand-edited or foreign config may hold a field of the
    wrong type (a string where a number belongs), which the conversions there meet as a TypeError or ValueError."""
    try:
        return release_to_config(cfg, target, weights)
    except UserError as e:
        raise UserError(f"release config {cfg_file}: {e}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise UserError(f"release config {cfg_file} has a field of the wrong type or shape ({e}); restore the "
                        "config.json the release shipped") from None


def load_release(path: str | os.PathLike, target):
    """A drafter from a Domino / DFlash / speculators release directory, bound to `target` (which supplies the
    embedding and the LM head)."""
    path = Path(path)
    cfg = read_config(path)
    if layout_of(cfg) is None:
        raise UserError(f"'{path}' is not a Domino / DFlash release directory")
    weights = _load_weights(path)
    dcfg = _config_of(path / "config.json", cfg, target, weights)
    state = release_to_state_dict(weights, dcfg)
    drafter = registry.family(dcfg.method)(dcfg)
    missing = sorted(set(drafter.state_dict()) - set(state))
    if missing:
        inv = {**{k: k[len("backbone."):] for k in missing if k.startswith("backbone.")}, **HEAD_TO_RELEASE}
        raise UserError(f"release checkpoint '{path}' lacks tensors: {[inv.get(k, k) for k in missing][:6]}")
    try:
        drafter.load_state_dict(state, strict=True)
    except RuntimeError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if "size mismatch" in ln]
        raise UserError(f"release checkpoint '{path}' does not match its config.json: "
                        f"{lines[0] if lines else str(e).splitlines()[0]}") from None
    return drafter.bind(target)
