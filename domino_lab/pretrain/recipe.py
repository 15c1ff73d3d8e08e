"""The pretraining recipe of a target LM (experiments/configs/target*.yaml, assistant.yaml): model shape, data mix,
optimisation and budgets, read through the shared config loader."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..config import from_dict, load_config, path_field
from ..errors import UserError
from ..validation import TRAIN_SEED_MAX, check_int, check_number, check_seed, check_threads

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "assets" / "target"
DEFAULT_CONFIG = "experiments/configs/target.yaml"
# a tokenizer trained here (data/tokenizer.py) holds the 256 byte symbols and the 2 special tokens at least
MIN_TRAINED_VOCAB = 256 + 2

# Every value is checked when its section is built (a YAML file, apply_quick, or a direct construction), so a bad
# recipe is one error naming the key as the YAML does (`train.lr`) before any folder is made or data is read.


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

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "intermediate_size", "max_position_embeddings"):
            check_int(getattr(self, name), f"model.{name}", 1)
        if self.head_dim % 2:
            raise UserError(f"model.head_dim must be even (RoPE rotates pairs of dimensions), got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError(f"model.num_key_value_heads ({self.num_key_value_heads}) must divide "
                            f"model.num_attention_heads ({self.num_attention_heads}): each key/value head serves a "
                            "whole group of query heads")
        # the RoPE base: at or below 1 the frequencies grow with the dimension instead of falling, and near 0 they
        # overflow and every loss is NaN
        check_number(self.rope_theta, "model.rope_theta", 1.0, low_open=True)


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

    def __post_init__(self):
        check_int(self.seq_len, "data.seq_len", 2, what=" (a window predicts its tokens from the ones before)")
        check_number(self.code_share, "data.code_share", 0.0, 1.0)
        for name in ("math_train_problems", "math_heldout_problems", "tokenizer_math_problems", "val_windows"):
            check_int(getattr(self, name), f"data.{name}", 1)
        if self.code_files is not None:
            check_int(self.code_files, "data.code_files", 1, what=" (or null: all files)")


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

    def __post_init__(self):
        check_seed(self.seed, "train.seed", TRAIN_SEED_MAX)
        check_int(self.batch_size, "train.batch_size", 1)
        check_number(self.lr, "train.lr", 0.0, low_open=True)
        check_number(self.min_lr_ratio, "train.min_lr_ratio", 0.0, 1.0)
        check_int(self.warmup_steps, "train.warmup_steps", 0)
        check_number(self.weight_decay, "train.weight_decay", 0.0)
        if not isinstance(self.betas, (list, tuple)) or len(self.betas) != 2:
            raise UserError(f"train.betas must be two numbers in [0, 1), e.g. [0.9, 0.95], got {self.betas!r}")
        for i, b in enumerate(self.betas):
            check_number(b, f"train.betas[{i}]", 0.0, 1.0, high_open=True)
        check_number(self.grad_clip, "train.grad_clip", 0.0)
        check_int(self.max_steps, "train.max_steps", 1)
        check_number(self.max_minutes, "train.max_minutes", 0.0, low_open=True)
        check_int(self.val_every_steps, "train.val_every_steps", 1)
        check_int(self.checkpoint_every_steps, "train.checkpoint_every_steps", 0, what=" (0: no checkpoints)")
        check_threads(self.threads, "train.threads")


@dataclass
class TargetRecipe:
    model: ModelShape = field(default_factory=ModelShape)
    data: DataRecipe = field(default_factory=DataRecipe)
    train: TrainRecipe = field(default_factory=TrainRecipe)
    out_dir: str | None = path_field(None)   # None: the shipped default target (domino_lab/assets/target)

    def __post_init__(self):
        own_tokenizer = not (self.train.init_from or self.train.tokenizer_from)
        if own_tokenizer and self.model.vocab_size < MIN_TRAINED_VOCAB:
            raise UserError(f"model.vocab_size must be at least {MIN_TRAINED_VOCAB} for a tokenizer trained here (256 "
                            f"byte symbols and 2 special tokens), got {self.model.vocab_size}")


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
