"""DrafterModule: one LightningModule trains every method (dflash, domino, eagle) on a frozen target.

Per step: the frozen target computes the tapped features of the whole sequence (no grad); random anchors;
every block goes through the drafter in one masked forward; loss = λ_t·CE(base) + (1-λ_t)·CE(final)
(dflash has only the base term). Validation adds per-position accuracy and τ measured by the real engine.
"""
from __future__ import annotations

import hashlib

import lightning.pytorch as pl
import torch
from transformers import get_cosine_schedule_with_warmup

from ..decoding import speculative_generate
from ..decoding.metrics import StepTally
from ..models import Drafter, DrafterConfig
from .config import TrainConfig, default_gamma
from .objective import sample_anchors, weighted_ce
from .schedules import make_schedule


class DrafterModule(pl.LightningModule):
    def __init__(self, cfg: TrainConfig, drafter_config: DrafterConfig, target=None):
        super().__init__()
        self.cfg = cfg
        self.save_hyperparameters({"train": cfg.to_logged_dict(), "drafter": _plain(drafter_config)})
        self.drafter = Drafter(drafter_config)
        self.schedule = make_schedule(cfg.loss.curriculum)
        self.gamma = cfg.loss.gamma or default_gamma(drafter_config.block_size)
        self.tau_prompts: list[list[int]] = []
        self._anchor_gen: torch.Generator | None = None
        if target is not None:
            self.attach_target(target)
        if cfg.drafter.init_from:
            from safetensors.torch import load_file

            src = Drafter.from_pretrained(cfg.drafter.init_from, target)   # checks it fits the target
            self.drafter.load_state_dict(src.state_dict())

    def attach_target(self, target) -> None:
        """The target is frozen and never saved in checkpoints: keep it outside the module tree."""
        self.__dict__["target"] = target
        self.drafter.bind(target)

    def on_fit_start(self) -> None:
        self.target.model.to(self.device)
        self._anchor_gen = torch.Generator(device=self.device)
        self._anchor_gen.manual_seed(self.cfg.seed * 1000 + self.global_rank)

    on_validation_start = on_fit_start

    # ---- training ------------------------------------------------------------------------------
    def _blocks(self, batch, prefix_mode):
        ids, lm = batch["input_ids"], batch["loss_mask"]
        feats = batch.get("features")
        if feats is not None:       # offline: computed once by the target (data/features.py)
            feats = feats.to(self.target.dtype)
        else:
            with torch.no_grad():
                feats = self.target.features(ids, self.drafter.config.target_layer_ids)
        anchors, keep = sample_anchors(lm, self.cfg.loss.num_anchors, self._anchor_gen)
        return self.drafter.training_blocks(feats, ids, lm, anchors, keep, prefix_mode)

    def lambda_now(self) -> float:
        if not self.drafter.has_head:
            return 1.0          # no correction: the base term is the whole loss
        return self.schedule(self.global_step + 1, self.cfg.max_steps)

    def training_step(self, batch, batch_idx):
        # anchors drawn from a per-step seed: a run resumed from a checkpoint draws what an uninterrupted one would
        self._anchor_gen.manual_seed(step_seed(self.cfg.seed, self.global_rank, self.global_step))
        bb = self._blocks(batch, self.cfg.loss.prefix_mode)
        lam = self.lambda_now()
        loss_base = weighted_ce(bb.logits_base, bb.labels, bb.valid, self.gamma)
        if not self.drafter.has_head:
            loss, loss_final = loss_base, loss_base
        else:
            loss_final = weighted_ce(bb.logits_final, bb.labels, bb.valid, self.gamma)
            loss = lam * loss_base + (1 - lam) * loss_final
        log = dict(on_step=True, on_epoch=False, batch_size=batch["input_ids"].shape[0])
        self.log("train/loss", loss, prog_bar=True, **log)
        self.log("train/loss_base", loss_base, **log)
        self.log("train/loss_final", loss_final, **log)
        self.log("train/lambda", lam, **log)
        self.log("train/lr", self.optimizers().param_groups[0]["lr"], **log)
        return loss

    # ---- validation ----------------------------------------------------------------------------
    def validation_step(self, batch, batch_idx):
        if batch_idx >= self.cfg.eval.val_batches:
            return
        bb = self._blocks(batch, "teacher_forcing")
        n = bb.labels.shape[-1]
        v = bb.valid.float()
        for name, logits in (("base", bb.logits_base), ("final", bb.logits_final)):
            hit = (logits.argmax(-1) == bb.labels).float() * v
            acc = hit.sum(dim=(0, 1)) / v.sum(dim=(0, 1)).clamp_min(1)
            for i in range(n):
                self.log(f"val/acc_{name}_pos_{i}", acc[i], on_epoch=True, sync_dist=True)
        self.log("val/loss_base", weighted_ce(bb.logits_base, bb.labels, bb.valid, self.gamma),
                 on_epoch=True, sync_dist=True)
        self.log("val/loss_final", weighted_ce(bb.logits_final, bb.labels, bb.valid, self.gamma),
                 on_epoch=True, sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking or not self.tau_prompts:
            return
        stats = measure_tau(self.target, self.drafter, self.tau_prompts, self.cfg.eval.tau_max_new_tokens)
        self.log("val/tau", stats["tau"], prog_bar=True, sync_dist=True)
        self.log("val/draft_ms", stats["draft_ms"], sync_dist=True)
        self.log("val/verify_ms", stats["verify_ms"], sync_dist=True)
        for i, a in enumerate(stats["accept_pos"]):
            if a is not None:        # a position no step reached has no acceptance to log
                self.log(f"val/accept_pos_{i}", a, sync_dist=True)

    # ---- optimisation ----------------------------------------------------------------------------
    def configure_optimizers(self):
        o = self.cfg.optim
        opt = torch.optim.AdamW(self.drafter.parameters(), lr=o.lr, weight_decay=o.weight_decay,
                                betas=tuple(o.betas))
        warmup = int(o.warmup_ratio * self.cfg.max_steps)
        sched = get_cosine_schedule_with_warmup(opt, warmup, self.cfg.max_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@torch.no_grad()
def measure_tau(target, drafter, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """τ, per-position acceptance and draft/verify ms (decoding.metrics) from real greedy decoding."""
    was_training = drafter.training
    drafter.eval()
    tally = StepTally(drafter.config.num_drafts)
    for p in prompts:
        tally.add(speculative_generate(target, drafter, prompt_ids=p, max_new_tokens=max_new_tokens).steps)
    drafter.train(was_training)
    out = tally.summary()
    return out | {"tau": out["tau"] or 0.0, "draft_ms": out["draft_ms"] or 0.0, "verify_ms": out["verify_ms"] or 0.0}


def step_seed(seed: int, rank: int, step: int) -> int:
    """A 64-bit generator seed for one (seed, rank, optimiser step)."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{rank}/{step}".encode(), digest_size=8).digest(), "little")


def _plain(obj):
    from dataclasses import asdict, is_dataclass
    return asdict(obj) if is_dataclass(obj) else obj
