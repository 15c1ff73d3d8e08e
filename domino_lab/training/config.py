"""TrainConfig: one typed recipe for drafter training (YAML in experiments/configs/, CLI overrides key=value)."""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field

from ..config import path_field
from ..errors import UserError, mask_credentials
from ..models.block import PREFIX_MODES
from ..models.config import DrafterConfig
from ..validation import TRAIN_SEED_MAX, check_int, check_number, check_seed
from .schedules import LambdaConfig, make_schedule


def _drafter_overrides() -> type:
    """`TrainConfig.drafter`: every DrafterConfig field as an optional override (None = what
    DrafterConfig.for_target derives from the target, or DrafterConfig's own default), plus two training-only keys.
    Generated from DrafterConfig, so the architecture's fields and defaults are written once."""
    hints = typing.get_type_hints(DrafterConfig)
    own = [(f.name, hints[f.name] | None, field(default=None))
           for f in dataclasses.fields(DrafterConfig) if f.name != "target_fingerprint"]
    return dataclasses.make_dataclass("DrafterOverrides", own + [
        ("num_taps", int, field(default=3)),              # taps spread from layer 1 to L-3 when target_layer_ids is None
                                                          # (at most: a small target may have fewer layers there)
        ("init_from", str | None, field(default=None)),   # warm start from a drafter directory (same target)
    ], namespace={"__module__": __name__})


DrafterOverrides = _drafter_overrides()


# What a warm start may change on top of its source drafter: the family and the head's shape (a dflash backbone
# gets a new Domino head) and the copy input (added on top of a drafter trained without one); every other field is
# the source's architecture, so its weights fit.
HEAD_FIELDS = ("method", "gru_hidden", "rank", "correct_first", "frspec_k", "copy_ngram")


def init_source_config(spec: str, target=None) -> dict:
    """config.json of the drafter `init_from` names (a shipped name or a drafter directory), without its weights.
    Given the target, an export in a release layout is read as `Drafter.from_pretrained` reads it (its fields are
    nested and named otherwise, and some follow from its weights), so a warm start takes that drafter's layers,
    taps and label convention, not the recipe's."""
    import json
    from pathlib import Path

    from ..models.drafter import SHIPPED_DRAFTERS
    from ..models.export import is_release_dir, load_release

    path = SHIPPED_DRAFTERS.get(str(spec), Path(spec))
    if target is not None and is_release_dir(path):
        return json.loads(load_release(path, target).config.to_json())
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"drafter.init_from {spec}: not a readable drafter directory ({e}); name a shipped "
                        "drafter (default, default-dflash, default-nocopy, ...) or a directory written by "
                        "domino_lab.train") from None


def drafter_config(overrides, target) -> DrafterConfig:
    """The DrafterConfig `overrides` (a DrafterOverrides) describe for `target`. With `init_from`, every field but
    HEAD_FIELDS comes from the source drafter (its layers, taps, width, block size, ...), whatever the recipe says,
    so a warm start follows the drafter it is given and its weights always fit."""
    from ..target import default_tap_layers

    over = {k: v for k, v in dataclasses.asdict(overrides).items()
            if v is not None and k not in ("num_taps", "init_from")}
    if overrides.init_from:
        src = init_source_config(overrides.init_from, target)
        names = {f.name for f in dataclasses.fields(DrafterConfig)} - {"target_fingerprint"} - set(HEAD_FIELDS)
        over = {**over, **{k: v for k, v in src.items() if k in names}}
    if "target_layer_ids" not in over:
        k = overrides.num_taps
        if not 1 <= k <= target.num_layers:
            raise UserError(f"drafter.num_taps must be from 1 to the target's {target.num_layers} layers, got {k}")
        over["target_layer_ids"] = default_tap_layers(target.num_layers, k)
    return DrafterConfig.for_target(target, over.pop("method", "domino"), **over)


@dataclass
class DataOptions:
    path: str = path_field("runs/regenerated/default")  # written by `python -m domino_lab.regenerate`
    # more regenerated folders whose rows join path's (e.g. the same prompts answered greedy and sampled); a prompt's
    # rows from every folder fall on the same side of the train/validation split, which hashes the prompt's id
    extra_paths: list[str] = path_field(default_factory=list)
    val_fraction: float = 0.05
    max_length: int = 512
    batch_size: int = 8
    num_workers: int = 0                   # 2 cores: loading is cheap, the target forward is not
    min_response_tokens: int = 4
    # "offline": the target's tapped features of every sequence are computed once and memory-mapped from
    # features_dir (domino_lab/data/features.py), so a step runs only the drafter; "online": the target runs
    # inside every step (GPUs, data too large to store)
    features: str = "online"
    features_dir: str = path_field("runs/features")

    def __post_init__(self):
        from ..errors import UserError

        if self.features not in ("online", "offline"):
            raise UserError(f"data.features must be 'online' or 'offline', got {self.features!r}")

    @property
    def paths(self) -> list[str]:
        """Every regenerated folder the drafter trains on: data.path, then data.extra_paths."""
        return [self.path, *self.extra_paths]


@dataclass
class LossOptions:
    num_anchors: int = 32
    gamma: float | None = None             # position decay exp(-i/γ); None: 7 for B=16, 4 for B=8 (DFlash)
    prefix_mode: str = "teacher_forcing"   # teacher_forcing (paper) | ttt (ablation)
    curriculum: LambdaConfig = field(default_factory=LambdaConfig)
    # weight α of the distillation term: each draft's loss is (1 − α)·CE(the response's next token) + α·KL(p_target
    # ‖ q_drafter), p_target the target's own next-token distribution at T = 1 (docs/design.md#soft-labels).
    # 0 = the paper's hard labels. Needs the target's logits, so data.features=online.
    soft_weight: float = 0.0


TRAIN_PARTS = ("all", "head", "backbone")
# Lightning's precision names this project trains with: mixed precision computes the drafter's matmuls in 16 bits
# and keeps float32 weights and optimiser state (the target always runs at its own dtype: training/module.py)
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "64-true")


@dataclass
class OptimOptions:
    lr: float = 6e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    grad_clip: float = 1.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    # what the optimiser trains: "all" (the whole drafter), "head" (the Domino head only, the backbone frozen
    # as drafter.init_from gave it: head-only sweeps on a trained backbone are several times cheaper per step and
    # measure the head's knobs instead of how far a fresh backbone got) or "backbone" (everything but the head,
    # which keeps drafter.init_from's weights: a fine-tune on new data that the head does not re-fit to)
    train: str = "all"


@dataclass
class EvalOptions:
    every_n_steps: int = 100
    val_batches: int = 4                   # batches of the validation split for loss/accuracy
    tau_prompts: int = 8                   # validation prompts decoded with the real engine for val/tau
    tau_max_new_tokens: int = 64
    # prompts decoded together for val/tau (batched greedy decoding, the same τ per prompt; 1 = one at a time).
    # Draft/verify ms stay per sequence: with tau_batch > 1 they come from the first prompt decoded alone.
    tau_batch: int = 1


@dataclass
class TrainConfig:
    target: str = "default"
    dtype: str = "float32"
    seed: int = 0
    max_steps: int = 1000
    drafter: DrafterOverrides = field(default_factory=DrafterOverrides)
    data: DataOptions = field(default_factory=DataOptions)
    loss: LossOptions = field(default_factory=LossOptions)
    optim: OptimOptions = field(default_factory=OptimOptions)
    eval: EvalOptions = field(default_factory=EvalOptions)
    out_dir: str = path_field("runs/train/domino")   # runs/...: under the runs folder
    experiment: str = "domino-lab"
    run_name: str | None = None
    tracking_uri: str | None = None        # None: sqlite:///<repository>/runs/mlflow.db
    # accelerator, devices and strategy go to Lightning's Trainer; training/devices.py checks them on this machine
    accelerator: str = "auto"              # auto, cpu, gpu, cuda, mps
    devices: int | str = 1                 # a count, "auto", -1 (every GPU) or GPU ids "0,1"
    num_nodes: int = 1
    strategy: str = "auto"                 # ddp, fsdp, ...
    precision: str | None = None           # None: bf16-mixed on GPU, 32-true on CPU
    checkpoint_every_n_steps: int = 50
    log_every_n_steps: int = 1
    progress_bar: bool = True
    threads: int | None = None             # torch threads per process (pin when processes share cores)

    def __post_init__(self):
        self.validate()

    def to_logged_dict(self) -> dict:
        """The config as a plain dict for what is logged and checkpointed (MLflow params, config.yaml, the
        checkpoint's hyperparameters): a password in the tracking URI is masked."""
        d = dataclasses.asdict(self)
        if d.get("tracking_uri"):
            d["tracking_uri"] = mask_credentials(d["tracking_uri"])
        return d

    def validate(self) -> "TrainConfig":
        """Every value in range, named by its key (a recipe, an override, a sweep trial or an experiment all
        build a TrainConfig, so all of them fail here, before any data, target or run is touched)."""
        check_seed(self.seed, "seed", TRAIN_SEED_MAX)
        check_int(self.max_steps, "max_steps", 1, what=" (optimiser steps to train)")
        check_int(self.checkpoint_every_n_steps, "checkpoint_every_n_steps", 1)
        check_int(self.log_every_n_steps, "log_every_n_steps", 1)
        check_int(self.num_nodes, "num_nodes", 1)
        from .devices import check_trainer_flags

        check_trainer_flags(self.accelerator, self.devices, self.strategy)
        if self.threads is not None:
            check_int(self.threads, "threads", 1)
        if self.precision is not None and str(self.precision) not in PRECISIONS:
            raise UserError(f"precision must be one of {list(PRECISIONS)} (or unset: bf16-mixed on a GPU, 32-true on "
                            f"a CPU), got {self.precision!r}")
        d = self.data
        check_number(d.val_fraction, "data.val_fraction", 0.0, 1.0, high_open=True)
        check_int(d.max_length, "data.max_length", 2)
        check_int(d.batch_size, "data.batch_size", 1)
        check_int(d.num_workers, "data.num_workers", 0)
        check_int(d.min_response_tokens, "data.min_response_tokens", 2,
                  what=" (an anchor and the token after it)")
        lo = self.loss
        check_int(lo.num_anchors, "loss.num_anchors", 1)
        if lo.gamma is not None:
            check_number(lo.gamma, "loss.gamma", 0.0, low_open=True)
        check_number(lo.soft_weight, "loss.soft_weight", 0.0, 1.0)
        if lo.soft_weight > 0 and d.features != "online":
            raise UserError("loss.soft_weight > 0 reads the target's logits, which offline features do not store; "
                            "set data.features=online or loss.soft_weight=0")
        if lo.prefix_mode not in PREFIX_MODES:
            raise UserError(f"loss.prefix_mode must be one of {list(PREFIX_MODES)}, got {lo.prefix_mode!r}")
        c = lo.curriculum
        try:
            make_schedule(c)
        except UserError as e:
            raise UserError(f"loss.curriculum: {e}") from None
        check_number(c.decay_ratio, "loss.curriculum.decay_ratio", 0.0, low_open=True)
        for i, m in enumerate(c.milestones):
            check_number(m, f"loss.curriculum.milestones[{i}]", 0.0, 1.0)
        check_number(c.gamma, "loss.curriculum.gamma", 0.0)
        o = self.optim
        check_number(o.lr, "optim.lr", 0.0, low_open=True)
        check_number(o.weight_decay, "optim.weight_decay", 0.0)
        check_number(o.warmup_ratio, "optim.warmup_ratio", 0.0, 1.0)
        check_number(o.grad_clip, "optim.grad_clip", 0.0)
        if len(o.betas) != 2:
            raise UserError(f"optim.betas must be two numbers, got {o.betas!r}")
        for i, b in enumerate(o.betas):
            check_number(b, f"optim.betas[{i}]", 0.0, 1.0, high_open=True)
        if o.train not in TRAIN_PARTS:
            raise UserError(f"optim.train must be one of {list(TRAIN_PARTS)}, got {o.train!r}")
        if o.train != "all" and not self.drafter.init_from:
            frozen = {"head": "backbone", "backbone": "head"}[o.train]
            raise UserError(f"optim.train={o.train} freezes the {frozen}, which would stay random; set "
                            "drafter.init_from to a trained drafter (e.g. default)")
        e = self.eval
        check_int(e.every_n_steps, "eval.every_n_steps", 1)
        check_int(e.val_batches, "eval.val_batches", 0)
        check_int(e.tau_prompts, "eval.tau_prompts", 0)
        check_int(e.tau_max_new_tokens, "eval.tau_max_new_tokens", 1)
        check_int(e.tau_batch, "eval.tau_batch", 1)
        from .tracking import check_tracking_uri

        check_tracking_uri(self.tracking_uri)
        return self


def default_gamma(block_size: int) -> float:
    """DFlash's guidance: γ=7 for B=16, 5 for B=10, 4 for B=8; roughly B/2 in between."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size * 7 / 16))
