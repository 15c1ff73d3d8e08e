"""DrafterDataModule: target-regenerated sequences (token ids + response loss mask), bucketed by length."""
from __future__ import annotations

import hashlib
import random
from functools import partial
from typing import Callable

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
    """Batches of similar length (little padding) in a random, seeded, epoch-dependent order.

    The order is a function of the seed and of a batch's place in the whole run: the run's batch k (per rank) is
    batch k % n of epoch k // n, n batches per epoch. `position` (training: the trainer's global step, restored
    from a checkpoint before the first batch is drawn) says where an iteration starts, so a run resumed mid-epoch
    trains on exactly the batches an uninterrupted run would have; without it, every iteration is the next epoch.
    """

    def __init__(self, lengths: list[int], batch_size: int, seed: int, shuffle: bool = True,
                 rank: int = 0, world: int = 1, position: Callable[[], int] | None = None):
        self.lengths, self.bs, self.seed, self.shuffle = lengths, batch_size, seed, shuffle
        self.rank, self.world, self.epoch = rank, world, 0
        self.position = position

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self, epoch: int = 0) -> list[list[int]]:
        idx = list(range(len(self.lengths)))
        rng = random.Random(self.seed + 1 + epoch)      # + 1: epoch 0 keeps the order earlier versions drew
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
        n = len(self)
        if self.position is None:
            start = self.epoch * n
            self.epoch += 1
        else:
            start = int(self.position())
        epoch, offset = divmod(start, n) if n else (0, 0)
        return iter(self._batches(epoch)[offset:])

    def __len__(self) -> int:
        return len(self._batches())


class StepOrderedLoader(DataLoader):
    """The training loader: its batch order follows from the seed and the trainer's restored global step
    (BucketBatchSampler's `position`), so there is no iterator state to save. The state_dict / load_state_dict
    pair tells Lightning this loader resumes mid-epoch correctly."""

    def state_dict(self) -> dict:
        return {"order": "by global step", "seed": self.batch_sampler.seed}

    def load_state_dict(self, state: dict) -> None:
        pass


def collate(rows: list[dict], features=None) -> dict:
    """Right padding: causal attention keeps real positions blind to the pads after them, and anchors
    (hence block contexts) only ever sit on real response tokens. `features` (a data.features.FeatureCache) adds
    the target's cached features [b, n, n_taps * H] (fp16; zeros on the pads)."""
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, : len(r["loss_mask"])] = torch.tensor(r["loss_mask"])
    out = {"input_ids": ids, "loss_mask": mask, "prompt_len": torch.tensor([r["prompt_len"] for r in rows])}
    if features is not None:
        feats = torch.zeros(len(rows), n, features.width, dtype=torch.float16)
        for i, r in enumerate(rows):
            feats[i, : len(r["input_ids"])] = features[r["id"]]
        out["features"] = feats
    return out


class DrafterDataModule(pl.LightningDataModule):
    def __init__(self, cfg: DataOptions, seed: int = 0):
        super().__init__()
        self.cfg, self.seed = cfg, seed
        self.train_rows: list[dict] = []
        self.val_rows: list[dict] = []
        self.features = None       # a data.features.FeatureCache of every row (data.features: offline)

    def setup(self, stage: str | None = None) -> None:
        if self.train_rows:
            return
        from ..data.regenerate import load_regenerated

        keep = []
        for k, path in enumerate(self.cfg.paths):
            for r in load_regenerated(path):
                ids, lm = r["input_ids"][: self.cfg.max_length], r["loss_mask"][: self.cfg.max_length]
                if sum(lm) >= self.cfg.min_response_tokens:
                    # folders answer the same prompts, so a row's own id (which keys the offline features)
                    # names its folder; the split hashes the prompt's id alone
                    row_id = r["id"] if k == 0 else f"{r['id']}#{k}"
                    keep.append({"id": row_id, "prompt_id": r["id"], "input_ids": ids, "loss_mask": lm,
                                 "prompt_len": r["prompt_len"]})
        if not keep:
            raise UserError(f"the dataset at {self.cfg.path} has no sequence with >= {self.cfg.min_response_tokens} "
                            "response tokens; regenerate it with `python -m domino_lab.regenerate`")
        held = {r["prompt_id"] for r in keep if _is_val(r["prompt_id"], self.cfg.val_fraction)}
        if not held:                   # tiny datasets: hold out at least one prompt, with its rows of every folder
            held = {keep[-1]["prompt_id"]}
        # The same prompt text can come under several ids (the stdlib's repeated boilerplate and repeated math
        # questions, in data regenerated before each text was asked once); hashing the id alone would put its copies
        # on both sides. A training row with a held-out row's prompt tokens joins validation, and only such rows:
        # every other row keeps the side its id hash gave it in earlier runs.
        val_prompts = {tuple(r["input_ids"][: r["prompt_len"]]) for r in keep if r["prompt_id"] in held}
        is_val = [r["prompt_id"] in held or tuple(r["input_ids"][: r["prompt_len"]]) in val_prompts for r in keep]
        self.val_rows = [r for r, v in zip(keep, is_val) if v]
        self.train_rows = [r for r, v in zip(keep, is_val) if not v]
        if not self.train_rows:
            raise UserError(f"the dataset at {self.cfg.path} is too small to split into train and validation")

    def check_batches(self, processes: int) -> None:
        """One error, before a run starts, when the training split has fewer batches than the processes sharing it:
        each process's share would be empty, and Lightning stops such a run without a step and without an error."""
        n = len(BucketBatchSampler([len(r["input_ids"]) for r in self.train_rows], self.cfg.batch_size, self.seed))
        if n < processes:
            raise UserError(f"the training split has {len(self.train_rows)} sequences, {n} batch(es) of "
                            f"data.batch_size {self.cfg.batch_size}, for {processes} processes (devices x num_nodes): "
                            "each process needs a batch; use fewer --devices, a smaller data.batch_size or more data")

    def _loader(self, rows, shuffle):
        # training batches are sharded over ranks; every rank validates on the whole (small) split
        sharded = shuffle and self.trainer is not None
        rank = self.trainer.global_rank if sharded else 0
        world = self.trainer.world_size if sharded else 1
        trainer = self.trainer if sharded else None
        sampler = BucketBatchSampler([len(r["input_ids"]) for r in rows], self.cfg.batch_size, self.seed,
                                     shuffle=shuffle, rank=rank, world=world,
                                     position=(lambda: trainer.global_step) if trainer is not None else None)
        loader = StepOrderedLoader if trainer is not None else DataLoader
        return loader(rows, batch_sampler=sampler, collate_fn=partial(collate, features=self.features),
                      num_workers=self.cfg.num_workers)

    def train_dataloader(self):
        return self._loader(self.train_rows, shuffle=True)

    def val_dataloader(self):
        return self._loader(self.val_rows, shuffle=False)

    def tau_prompts(self, n: int) -> list[list[int]]:
        """A small fixed prompt set for val/tau: prompts of held-out sequences (never trained on), each once
        (several data folders answer the same prompts)."""
        first = {}
        for r in self.val_rows:
            first.setdefault(r["prompt_id"], r)
        return [r["input_ids"][: r["prompt_len"]] for r in list(first.values())[:n]]
