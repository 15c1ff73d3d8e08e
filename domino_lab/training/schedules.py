"""λ_t schedules for the base-anchored curriculum: loss = λ_t·CE(base) + (1-λ_t)·CE(final).

Pluggable objects with one method, `__call__(step, total_steps) -> λ in [0, 1]`; `step` counts optimiser steps
from 1. The paper's default is `linear` from 1 to 0 over all steps; `constant 0` is "no curriculum".
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import UserError


@dataclass
class LambdaConfig:
    type: str = "linear"            # linear | cosine | step | constant
    start: float = 1.0              # λ at step 0
    decay_ratio: float = 1.0        # linear/cosine: reach 0 at decay_ratio * total_steps
    milestones: list[float] = field(default_factory=lambda: [0.5])   # step: fractions of total steps
    gamma: float = 0.0              # step: λ is multiplied by gamma at each milestone


class Linear:
    def __init__(self, start: float, decay_ratio: float):
        self.start, self.decay_ratio = start, decay_ratio

    def __call__(self, step: int, total: int) -> float:
        return min(1.0, max(0.0, self.start * (1 - step / max(1e-9, self.decay_ratio * total))))


class Cosine:
    def __init__(self, start: float, decay_ratio: float):
        self.start, self.decay_ratio = start, decay_ratio

    def __call__(self, step: int, total: int) -> float:
        frac = min(1.0, step / max(1e-9, self.decay_ratio * total))
        return min(1.0, max(0.0, self.start * 0.5 * (1 + math.cos(math.pi * frac))))


class Step:
    def __init__(self, start: float, milestones: list[float], gamma: float):
        self.start, self.milestones, self.gamma = start, sorted(milestones), gamma

    def __call__(self, step: int, total: int) -> float:
        passed = sum(step >= m * total for m in self.milestones)
        return min(1.0, max(0.0, self.start * self.gamma ** passed))


class Constant:
    def __init__(self, start: float):
        self.value = start

    def __call__(self, step: int, total: int) -> float:
        return min(1.0, max(0.0, self.value))


def make_schedule(cfg: LambdaConfig):
    if not 0.0 <= cfg.start <= 1.0:
        raise UserError(f"lambda start must be in [0, 1], got {cfg.start}")
    if cfg.type == "linear":
        return Linear(cfg.start, cfg.decay_ratio)
    if cfg.type == "cosine":
        return Cosine(cfg.start, cfg.decay_ratio)
    if cfg.type == "step":
        return Step(cfg.start, cfg.milestones, cfg.gamma)
    if cfg.type == "constant":
        return Constant(cfg.start)
    raise UserError(f"unknown lambda schedule '{cfg.type}'; use linear, cosine, step or constant")
