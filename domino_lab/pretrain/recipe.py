"""The pretraining recipe of a target LM (experiments/configs/target*.yaml, assistant.yaml): model shape, data mix,
optimisation and budgets, read through the shared config loader."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..config import from_dict, load_config, path_field
from ..errors import UserError

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "assets" / "target"
DEFAULT_CONFIG = "experiments/configs/target.yaml"


@dataclass
class ModelShape:
    vocab_size: int = 8192
    hidden_size: int = 256
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0


@dataclass
class DataRecipe:
    seq_len: int = 512
    code_share: float = 0.5            # share of training windows (= tokens) drawn from code
    math_train_problems: int = 60_000  # more than one run consumes, so math is never repeated
    math_heldout_problems: int = 2_000
    tokenizer_math_problems: int = 40_000
    code_files: int | None = None      # first N train files only (quick runs); None = all
    val_windows: int = 32              # held-out windows per domain for validation
    # train on a target's regenerated responses instead of the corpora (an assistant model for
    # `hf-assisted` learns the target's own distribution): a `python -m domino_lab.regenerate` folder
    regenerated: str | None = path_field(None)


@dataclass
class TrainRecipe:
    seed: int = 0
    batch_size: int = 4
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0
    max_steps: int = 100_000
    max_minutes: float = 60.0
    val_every_steps: int = 500
    checkpoint_every_steps: int = 500
    threads: int = 2
    # continue from an exported target (a second stage with another data mix / budget); its tokenizer is
    # reused as is, and train_meta.json accumulates tokens, steps and wall time over the stages
    init_from: str | None = path_field(None)
    # from scratch, but with this exported model's tokenizer (an assistant must share the target's)
    tokenizer_from: str | None = path_field(None)


@dataclass
class TargetRecipe:
    model: ModelShape = field(default_factory=ModelShape)
    data: DataRecipe = field(default_factory=DataRecipe)
    train: TrainRecipe = field(default_factory=TrainRecipe)
    out_dir: str | None = path_field(None)   # None: the shipped default target (domino_lab/assets/target)


# Toy shape for `--quick`: a few hundred tokens end to end in seconds.
QUICK_OVERRIDES = {
    "model": dict(vocab_size=384, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=16, intermediate_size=64, max_position_embeddings=256),
    "data": dict(seq_len=64, math_train_problems=200, math_heldout_problems=20, tokenizer_math_problems=200,
                 code_files=10, val_windows=2),
    "train": dict(batch_size=2, max_steps=3, warmup_steps=1, max_minutes=5.0, val_every_steps=1000,
                  checkpoint_every_steps=0),
}


def recipe_from_dict(raw: dict, where: str = "recipe") -> TargetRecipe:
    """Typed recipe from a mapping; unknown keys and wrong types name the key (shared loader, domino_lab.config)."""
    if not isinstance(raw, dict):
        raise UserError(f"{where} must be a YAML mapping with sections model, data, train")
    return from_dict(TargetRecipe, raw)


def load_recipe(path: str | os.PathLike = DEFAULT_CONFIG, runs_dir: str | os.PathLike | None = None) -> TargetRecipe:
    """A recipe YAML (found from any directory); `runs/...` paths in it resolve under `runs_dir`."""
    return load_config(TargetRecipe, path, runs_dir=runs_dir)


def apply_quick(recipe: TargetRecipe) -> TargetRecipe:
    d = asdict(recipe)
    for sec, over in QUICK_OVERRIDES.items():
        d[sec].update(over)
    return recipe_from_dict(d)
