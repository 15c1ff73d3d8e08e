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
from ..decoding.lookup import block_copy_inputs
from ..decoding.metrics import StepTally
from ..models import Drafter, DrafterConfig
from .config import TrainConfig, default_gamma
from .objective import sample_anchors, target_log_probs, weighted_ce, weighted_kl
from .schedules import make_schedule


class DrafterModule(pl.LightningModule):
    def __init__(self, cfg: TrainConfig, drafter_config: DrafterConfig, target=None, data_digest: str | None = None):
        """data_digest: the training data's content digest (data.regenerate.data_digest; "+"-joined for several
        paths), kept in the checkpoints and in every exported drafter, so a run says which data it learned from."""
        super().__init__()
        self.cfg = cfg
        self.save_hyperparameters({"train": cfg.to_logged_dict(), "drafter": _plain(drafter_config),
                                   **({"data_digest": data_digest} if data_digest else {})})
        self.drafter = Drafter(drafter_config)
        self.schedule = make_schedule(cfg.loss.curriculum)
        self.gamma = cfg.loss.gamma or default_gamma(drafter_config.block_size)
        self.tau_prompts: list[list[int]] = []
        self._anchor_gen: torch.Generator | None = None
        if target is not None:
            self.attach_target(target)
        self.warm_started: set[str] = set()      # state keys taken from drafter.init_from
        if cfg.drafter.init_from:
            src = Drafter.from_pretrained(cfg.drafter.init_from, target)   # checks it fits the target
            self.warm_started = warm_start(self.drafter, src, head=cfg.optim.train != "head",
                                           name=cfg.drafter.init_from)
        if cfg.optim.train != "all":
            train_only(self.drafter, cfg.optim.train, self.warm_started)

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
    def _blocks(self, batch, prefix_mode, soft: bool = False):
        """The blocks' logits, and (`soft`) the target's log-distribution [b, N, n, V] over what each draft
        predicts, else None."""
        ids, lm = batch["input_ids"], batch["loss_mask"]
        feats, states = batch.get("features"), None
        if feats is not None:       # offline: computed once by the target (data/features.py)
            feats = feats.to(self.target.dtype)
        else:
            # the target computes at its own dtype even under mixed precision: the drafter must learn from the
            # features it will read when decoding, not from a bf16 rendition of them
            taps = self.drafter.config.target_layer_ids
            with torch.no_grad(), torch.autocast(ids.device.type, enabled=False):
                if soft:
                    feats, states = self.target.features(ids, taps, final_states=True)
                else:
                    feats = self.target.features(ids, taps)
        anchors, keep = sample_anchors(lm, self.cfg.loss.num_anchors, self._anchor_gen)
        k = self.drafter.config.copy_ngram
        copy = block_copy_inputs(ids, anchors, self.drafter.config.num_drafts, k) if k else None
        bb = self.drafter.training_blocks(feats, ids, lm, anchors, keep, prefix_mode, copy=copy)
        if states is None:
            return bb, None
        with torch.no_grad(), torch.autocast(ids.device.type, enabled=False):
            return bb, target_log_probs(states, self.target.lm_head, anchors, bb.labels.shape[-1])

    def _label_loss(self, logits, bb, target_logp):
        """(1 − α)·CE(labels) + α·KL(target ‖ drafter), position-weighted (α = loss.soft_weight)."""
        a = self.cfg.loss.soft_weight
        hard = weighted_ce(logits, bb.labels, bb.valid, self.gamma) if a < 1 else 0.0
        if target_logp is None:
            return hard
        return (1 - a) * hard + a * weighted_kl(logits, target_logp, bb.valid, self.gamma)

    def provenance(self) -> dict:
        """What an exported drafter records about its training (models.drafter.read_provenance)."""
        target = self.__dict__.get("target")
        out = {"data_digest": self.hparams.get("data_digest"), "seed": self.cfg.seed, "step": int(self.global_step),
               "target_digest": getattr(target, "weights_digest", None), "init_from": self.cfg.drafter.init_from}
        return {k: v for k, v in out.items() if v is not None}

    def lambda_now(self) -> float:
        if not self.drafter.has_head:
            return 1.0          # no correction: the base term is the whole loss
        return self.schedule(self.global_step + 1, self.cfg.max_steps)

    def training_step(self, batch, batch_idx):
        # anchors drawn from a per-step seed: a run resumed from a checkpoint draws what an uninterrupted one would
        self._anchor_gen.manual_seed(step_seed(self.cfg.seed, self.global_rank, self.global_step))
        bb, target_logp = self._blocks(batch, self.cfg.loss.prefix_mode, soft=self.cfg.loss.soft_weight > 0)
        lam = self.lambda_now()
        loss_base = self._label_loss(bb.logits_base, bb, target_logp)
        if not self.drafter.has_head:
            loss, loss_final = loss_base, loss_base
        else:
            loss_final = self._label_loss(bb.logits_final, bb, target_logp)
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
        bb, _ = self._blocks(batch, "teacher_forcing")
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
        stats = measure_tau(self.target, self.drafter, self.tau_prompts, self.cfg.eval.tau_max_new_tokens,
                            batch=self.cfg.eval.tau_batch)
        self.log("val/tau", stats["tau"], prog_bar=True, sync_dist=True)
        self.log("val/draft_ms", stats["draft_ms"], sync_dist=True)
        self.log("val/verify_ms", stats["verify_ms"], sync_dist=True)
        for i, a in enumerate(stats["accept_pos"]):
            if a is not None:        # a position no step reached has no acceptance to log
                self.log(f"val/accept_pos_{i}", a, sync_dist=True)

    # ---- optimisation ----------------------------------------------------------------------------
    def configure_optimizers(self):
        o = self.cfg.optim
        params = [p for p in self.drafter.parameters() if p.requires_grad]     # optim.train=head: the head only
        opt = torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay,
                                betas=tuple(o.betas))
        warmup = int(o.warmup_ratio * self.cfg.max_steps)
        sched = get_cosine_schedule_with_warmup(opt, warmup, self.cfg.max_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def warm_start(drafter, src, head: bool = True, name: str = "init_from") -> set[str]:
    """Copy `src`'s weights into `drafter` and return the state keys taken. The backbone must match exactly (same
    family layout and shapes: the config took the source's architecture, training/config.py#drafter_config). The
    head is copied when `head` and both have one of the same shape; a source without a head (a dflash backbone
    under a domino drafter) leaves the new head as initialised; an FR-Spec list is taken only when it has this
    drafter's size. Anything else is a UserError naming the first tensor that does not fit."""
    from ..errors import UserError

    head_keys, src_head = _head_keys(drafter), _head_keys(src)
    want, have = drafter.state_dict(), src.state_dict()
    take = {}
    for k, v in have.items():
        if k in src_head and (not head or k not in want):
            continue                      # the source's head is not wanted, or this drafter has none
        if k == "frspec_ids" and (k not in want or want[k].shape != v.shape):
            continue                      # an FR-Spec list of another size is not a weight (train.py makes one)
        if k not in want or want[k].shape != v.shape:
            got = "is missing" if k not in want else f"is {list(want[k].shape)}, the source's {list(v.shape)}"
            raise UserError(f"drafter.init_from {name}: its weights do not fit this drafter ({k} {got}); warm-start "
                            "from a drafter with the same backbone, and set the head's rank/gru_hidden to the "
                            "source's or train the head from scratch (optim.train=head)")
        take[k] = v
    # a copy input the source lacks starts as initialised (the source then drafts as before: see CopyInput)
    copy_keys = {k for k in want if k.split(".", 1)[0] == "copy_input"} - set(have)
    # (an FR-Spec list the source lacks, or of another size, is made from the training data instead: train.py)
    missing = set(want) - set(take) - head_keys - copy_keys - {"frspec_ids"}
    if missing:
        raise UserError(f"drafter.init_from {name}: the source lacks {sorted(missing)[0]}")
    drafter.load_state_dict(take, strict=False)
    return set(take)


def _head_keys(drafter) -> set[str]:
    """State-dict keys of the drafter's head (empty for a family without one)."""
    head = drafter.body_parts().get("head")
    names = [n for n, m in drafter.named_children() if m is head] if head is not None else []
    return {k for k in drafter.state_dict() if names and k.split(".", 1)[0] == names[0]}


def train_only(drafter, part: str, warm_started: set[str] = frozenset()) -> None:
    """optim.train=head: only the Domino head trains. Nothing upstream of the head then needs a gradient, so
    autograd records no backbone operation (the backbone's forward costs what it costs under no_grad).
    optim.train=backbone: the head keeps the weights drafter.init_from gave it and the rest trains, to fine-tune
    the backbone on new data without the head re-fitting to it (docs/design.md#frozen-head)."""
    from ..errors import UserError

    head = drafter.body_parts().get("head") if drafter.has_head else None
    if head is None:
        raise UserError(f"optim.train={part} needs a drafter with a head (method domino), not "
                        f"'{drafter.config.method}'")
    if part == "backbone" and not _head_keys(drafter) <= set(warm_started):
        raise UserError("optim.train=backbone freezes the head, which would stay as initialised: drafter.init_from "
                        "has no head of this shape; warm-start from a domino drafter with the same rank/gru_hidden")
    in_head = {id(p) for p in head.parameters()}
    for p in drafter.parameters():
        p.requires_grad_((id(p) in in_head) == (part == "head"))


@torch.no_grad()
def measure_tau(target, drafter, prompts: list[list[int]], max_new_tokens: int, batch: int = 1) -> dict:
    """τ, per-position acceptance, per-prompt τ and draft/verify ms (decoding.metrics) from real greedy decoding.

    batch > 1 decodes the prompts `batch` at a time (decoding/batched.py: every row's greedy output, hence its
    τ, is the one it gets alone; several times faster on a CPU, where one 9-token verify forward is mostly
    overhead). Step times are per sequence, so they then come from the first prompt decoded alone. Per-position
    acceptance is counted from committed lengths there (a step cut by EOS or the token budget counts as a
    rejection at the cut)."""
    was_training = drafter.training
    drafter.eval()
    try:
        # real decoding, at the target's and drafter's own dtypes, whatever precision the caller trains in
        with torch.autocast(target.device.type, enabled=False):
            if batch > 1 and drafter.supports_batched and len(prompts) > 1:
                out = _measure_batched(target, drafter, prompts, max_new_tokens, batch)
            else:
                tally = StepTally(drafter.config.num_drafts)
                per_prompt = []
                for i, p in enumerate(prompts):
                    steps = speculative_generate(target, drafter, prompt_ids=p, max_new_tokens=max_new_tokens).steps
                    tally.add(steps)
                    per_prompt.append(_prompt_row(i, [s.acceptance_length for s in steps]))
                out = tally.summary() | {"per_prompt": per_prompt}
    finally:
        drafter.train(was_training)
    return out | {"tau": out["tau"] or 0.0, "draft_ms": out["draft_ms"] or 0.0, "verify_ms": out["verify_ms"] or 0.0}


def _prompt_row(i: int, lengths: list[int]) -> dict:
    """One prompt's τ in the layout evaluate.paired reads ({"id", "tau", "steps"})."""
    return {"id": str(i), "tau": sum(lengths) / len(lengths) if lengths else 0.0, "steps": len(lengths)}


def _measure_batched(target, drafter, prompts, max_new_tokens: int, batch: int) -> dict:
    from ..decoding.batched import batched_generate

    n = drafter.config.num_drafts
    reached, accepted = [0] * n, [0] * n
    per_prompt, committed, steps = [], 0, 0
    for lo in range(0, len(prompts), batch):
        res = batched_generate(target, drafter, prompts[lo:lo + batch], max_new_tokens=max_new_tokens,
                               drafts="all")     # τ of the whole block, as decoded one at a time
        for r, lengths in enumerate(res.acceptance_lengths):
            per_prompt.append(_prompt_row(lo + r, lengths))
            committed, steps = committed + sum(lengths), steps + len(lengths)
            for length in lengths:
                acc = min(length - 1, n)
                for i in range(min(n, acc + 1)):
                    reached[i] += 1
                    accepted[i] += int(i < acc)
    timing = StepTally(n).add(speculative_generate(target, drafter, prompt_ids=prompts[0],
                                                   max_new_tokens=max_new_tokens).steps)
    return {"tau": committed / steps if steps else None, "steps": steps, "per_prompt": per_prompt,
            "accept_pos": [a / r if r else None for a, r in zip(accepted, reached)],
            "draft_ms": timing.draft_ms, "verify_ms": timing.verify_ms}


def step_seed(seed: int, rank: int, step: int) -> int:
    """A 64-bit generator seed for one (seed, rank, optimiser step)."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{rank}/{step}".encode(), digest_size=8).digest(), "little")


def _plain(obj):
    from dataclasses import asdict, is_dataclass
    return asdict(obj) if is_dataclass(obj) else obj
