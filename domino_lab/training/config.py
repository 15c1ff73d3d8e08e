"""TrainConfig: one typed recipe for drafter training (YAML in experiments/configs/, CLI overrides key=value)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .schedules import LambdaConfig


@dataclass
class DrafterOptions:
    method: str = "domino"                 # dflash | domino | eagle (EAGLE-3-style chain, same token budget)
    num_layers: int = 1
    block_size: int = 8
    gru_hidden: int = 256                  # g
    rank: int = 64                         # r
    shift_label: bool = True
    target_layer_ids: list[int] | None = None   # None: num_taps layers spread from 1 to L-3
    num_taps: int = 3
    intermediate_size: int | None = None   # None: the target's
    init_from: str | None = None           # warm start from a drafter directory (same target)
    frspec_k: int = 0                      # FR-Spec: draft among the K most frequent response tokens (0 = off)


@dataclass
class DataOptions:
    path: str = "runs/regenerated/default"  # a dataset written by `python -m domino_lab.regenerate`
    val_fraction: float = 0.05
    max_length: int = 512
    batch_size: int = 8
    num_workers: int = 0                   # 2 cores: loading is cheap, the target forward is not
    min_response_tokens: int = 4


@dataclass
class LossOptions:
    num_anchors: int = 32
    gamma: float | None = None             # position decay exp(-i/γ); None: 7 for B=16, 4 for B=8 (DFlash)
    prefix_mode: str = "teacher_forcing"   # teacher_forcing (paper) | ttt (ablation)
    curriculum: LambdaConfig = field(default_factory=LambdaConfig)


@dataclass
class OptimOptions:
    lr: float = 6e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    grad_clip: float = 1.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])


@dataclass
class EvalOptions:
    every_n_steps: int = 100
    val_batches: int = 4                   # batches of the validation split for loss/accuracy
    tau_prompts: int = 8                   # validation prompts decoded with the real engine for val/tau
    tau_max_new_tokens: int = 64


@dataclass
class TrainConfig:
    target: str = "default"
    dtype: str = "float32"
    seed: int = 0
    max_steps: int = 1000
    drafter: DrafterOptions = field(default_factory=DrafterOptions)
    data: DataOptions = field(default_factory=DataOptions)
    loss: LossOptions = field(default_factory=LossOptions)
    optim: OptimOptions = field(default_factory=OptimOptions)
    eval: EvalOptions = field(default_factory=EvalOptions)
    out_dir: str = "runs/train/domino"
    experiment: str = "domino-lab"
    run_name: str | None = None
    tracking_uri: str | None = None        # None: sqlite:///<repo runs>/mlflow.db
    accelerator: str = "auto"
    devices: int | str = 1
    num_nodes: int = 1
    strategy: str = "auto"                 # ddp, fsdp, ...
    precision: str | None = None           # None: bf16-mixed on GPU, 32-true on CPU
    checkpoint_every_n_steps: int = 50
    log_every_n_steps: int = 1
    progress_bar: bool = True
    threads: int | None = None             # torch threads per process (pin when processes share cores)


def default_gamma(block_size: int) -> float:
    """DFlash's guidance: γ=7 for B=16, 5 for B=10, 4 for B=8; roughly B/2 in between."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size * 7 / 16))
