"""DrafterDataModule: target-regenerated sequences (token ids + response loss mask), bucketed by length."""
from __future__ import annotations

import hashlib
import random

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Sampler

from ..errors import UserError
from .config import DataOptions


def _is_val(row_id: str, frac: float) -> bool:
    # a stable hash split: the same sequences are held out on every run and every rank
    h = int(hashlib.sha1(str(row_id).encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < frac


class BucketBatchSampler(Sampler[list[int]]):
    """Batches of similar length (little padding) in a random, seeded, epoch-dependent order."""

    def __init__(self, lengths: list[int], batch_size: int, seed: int, shuffle: bool = True,
                 rank: int = 0, world: int = 1):
        self.lengths, self.bs, self.seed, self.shuffle = lengths, batch_size, seed, shuffle
        self.rank, self.world, self.epoch = rank, world, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self) -> list[list[int]]:
        idx = list(range(len(self.lengths)))
        rng = random.Random(self.seed + self.epoch)
        if self.shuffle:
            rng.shuffle(idx)
        chunk = self.bs * 32
        batches = []
        for i in range(0, len(idx), chunk):
            part = sorted(idx[i:i + chunk], key=lambda j: self.lengths[j])
            batches += [part[k:k + self.bs] for k in range(0, len(part), self.bs)]
        if self.shuffle:
            rng.shuffle(batches)
        usable = len(batches) - len(batches) % self.world if self.world > 1 else len(batches)
        return batches[self.rank:usable:self.world]

    def __iter__(self):
        self.epoch += 1
        return iter(self._batches())

    def __len__(self) -> int:
        return len(self._batches())


def collate(rows: list[dict]) -> dict:
    """Right padding: causal attention keeps real positions blind to the pads after them, and anchors
    (hence block contexts) only ever sit on real response tokens."""
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, : len(r["loss_mask"])] = torch.tensor(r["loss_mask"])
    return {"input_ids": ids, "loss_mask": mask, "prompt_len": torch.tensor([r["prompt_len"] for r in rows])}


class DrafterDataModule(pl.LightningDataModule):
    def __init__(self, cfg: DataOptions, seed: int = 0):
        super().__init__()
        self.cfg, self.seed = cfg, seed
        self.train_rows: list[dict] = []
        self.val_rows: list[dict] = []

    def setup(self, stage: str | None = None) -> None:
        if self.train_rows:
            return
        from ..data.regenerate import load_regenerated

        ds = load_regenerated(self.cfg.path)
        keep = []
        for r in ds:
            ids, lm = r["input_ids"][: self.cfg.max_length], r["loss_mask"][: self.cfg.max_length]
            if sum(lm) >= self.cfg.min_response_tokens:
                keep.append({"id": r["id"], "input_ids": ids, "loss_mask": lm, "prompt_len": r["prompt_len"]})
        if not keep:
            raise UserError(f"the dataset at {self.cfg.path} has no sequence with >= {self.cfg.min_response_tokens} "
                            "response tokens; regenerate it with `python -m domino_lab.regenerate`")
        self.val_rows = [r for r in keep if _is_val(r["id"], self.cfg.val_fraction)]
        self.train_rows = [r for r in keep if not _is_val(r["id"], self.cfg.val_fraction)]
        if not self.val_rows:          # tiny datasets: hold out at least one sequence
            self.val_rows = self.train_rows[-1:]
            self.train_rows = self.train_rows[:-1] or self.val_rows
        if not self.train_rows:
            raise UserError(f"the dataset at {self.cfg.path} is too small to split into train and validation")

    def _loader(self, rows, shuffle):
        # training batches are sharded over ranks; every rank validates on the whole (small) split
        sharded = shuffle and self.trainer is not None
        rank = self.trainer.global_rank if sharded else 0
        world = self.trainer.world_size if sharded else 1
        sampler = BucketBatchSampler([len(r["input_ids"]) for r in rows], self.cfg.batch_size, self.seed,
                                     shuffle=shuffle, rank=rank, world=world)
        return DataLoader(rows, batch_sampler=sampler, collate_fn=collate, num_workers=self.cfg.num_workers)

    def train_dataloader(self):
        return self._loader(self.train_rows, shuffle=True)

    def val_dataloader(self):
        return self._loader(self.val_rows, shuffle=False)

    def tau_prompts(self, n: int) -> list[list[int]]:
        """A small fixed prompt set for val/tau: prompts of held-out sequences (never trained on)."""
        return [r["input_ids"][: r["prompt_len"]] for r in self.val_rows[:n]]
