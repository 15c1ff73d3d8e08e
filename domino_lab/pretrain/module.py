"""The LightningModule that pretrains a target LM (a from-scratch Qwen3, or a previous export continued), the
Qwen3 configuration of a recipe's shape, and the plain progress lines of a long unattended run."""
from __future__ import annotations

import math
import sys
import time
from collections import deque
from dataclasses import asdict

import lightning.pytorch as pl
import torch
from transformers import Qwen3ForCausalLM

from ..data.packing import DOMAINS
from ..errors import UserError
from .recipe import ModelShape, TrainRecipe


def qwen3_config(shape: ModelShape, eos_id: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim, intermediate_size=shape.intermediate_size,
        max_position_embeddings=shape.max_position_embeddings, rope_theta=shape.rope_theta,
        tie_word_embeddings=True,  # halves the parameter count of a small-vocab model; the asset must stay < 20 MB
        eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=None,
    )


class TargetLM(pl.LightningModule):
    """Next-token LM training of a from-scratch Qwen3; the loss is the HF causal-LM loss."""

    def __init__(self, shape: ModelShape, train: TrainRecipe, eos_id: int):
        super().__init__()
        self.save_hyperparameters({"model": asdict(shape), "train": asdict(train), "eos_id": eos_id})
        self.shape, self.train_cfg = shape, train
        if train.init_from:
            self.model = Qwen3ForCausalLM.from_pretrained(train.init_from, dtype=torch.float32)
            if self.model.config.hidden_size != shape.hidden_size or \
                    self.model.config.num_hidden_layers != shape.num_hidden_layers:
                raise UserError(f"train.init_from {train.init_from} has another shape than the recipe's model")
        else:
            self.model = Qwen3ForCausalLM(qwen3_config(shape, eos_id))
        self._t0: float | None = None
        self.recent_losses: deque[float] = deque(maxlen=50)
        self.tokens_seen = 0

    # progress in [0, 1] on both budgets: max(step / max_steps, elapsed / max_minutes), so the cosine decays
    # fully even when a shared machine runs fewer steps than planned
    def progress(self, step: int) -> float:
        by_steps = step / self.train_cfg.max_steps
        if self._t0 is None:
            return by_steps
        return max(by_steps, (time.monotonic() - self._t0) / (60.0 * self.train_cfg.max_minutes))

    def lr_factor(self, step: int) -> float:
        c = self.train_cfg
        if step < c.warmup_steps:
            return (step + 1) / c.warmup_steps
        p = min(1.0, self.progress(step))
        return c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p))

    def on_train_start(self):
        self._t0 = time.monotonic()

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.tokens_seen += batch.numel()
        self.recent_losses.append(float(loss.detach()))
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/lr", self.optimizers().param_groups[0]["lr"])
        self.log("train/tokens", float(self.tokens_seen))
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.progress(self.global_step) >= 1.0:
            self.trainer.should_stop = True

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log(f"val/loss_{DOMAINS[dataloader_idx]}", loss, add_dataloader_idx=False, prog_bar=True)

    def configure_optimizers(self):
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            # norms' gains stay undecayed; the (tied) embedding is a matrix and is decayed like the rest
            (decay if p.ndim >= 2 else no_decay).append(p)
        c = self.train_cfg
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": c.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=c.lr, betas=tuple(c.betas))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, self.lr_factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class ProgressLines(pl.Callback):
    """One plain line per `every` steps (the nohup'd full run logs to a file, where a tqdm bar is noise)."""

    def __init__(self, every: int = 25):
        self.every = every

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step % self.every == 0 and module._t0 is not None:
            el = time.monotonic() - module._t0
            loss = sum(module.recent_losses) / max(1, len(module.recent_losses))
            print(f"step {step} loss {loss:.3f} lr {trainer.optimizers[0].param_groups[0]['lr']:.2e} "
                  f"tokens {module.tokens_seen} tok/s {module.tokens_seen / max(el, 1e-9):.0f} "
                  f"elapsed {el / 60:.1f}min progress {module.progress(step):.3f}", file=sys.stderr, flush=True)

    def on_validation_end(self, trainer, module):
        vals = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        print(f"step {trainer.global_step} validation {vals}", file=sys.stderr, flush=True)
