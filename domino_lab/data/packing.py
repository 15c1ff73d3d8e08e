"""Packed language-model data for target pretraining: documents joined by `<|endoftext|>` into one
token stream per domain, cut into fixed-length windows, code and math mixed by a fixed share.

Training windows start at random offsets of the stream (sampling with replacement), so a corpus
smaller than the token budget is revisited at different alignments instead of as identical
chunks. Validation uses fixed, aligned windows of the held-out streams, one loader per domain.
"""
from __future__ import annotations

import numpy as np
import torch
import lightning.pytorch as pl
from torch.utils.data import DataLoader, Dataset, IterableDataset
from tqdm.auto import tqdm

from domino_lab.data.tokenizer import EOS_TOKEN, MASK_TOKEN
from domino_lab.errors import UserError

DOMAINS = ("code", "math")


def token_stream(tokenizer, texts, desc: str, batch: int = 256) -> np.ndarray:
    """Token ids of all `texts`, each followed by EOS, as one int32 array."""
    backend = tokenizer.backend_tokenizer  # raw tokenizers object: no max-length warnings, fast batching
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    mask = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    texts = list(texts)
    parts = []
    for i in tqdm(range(0, len(texts), batch), desc=f"tokenizing {desc}", unit="batch"):
        for enc in backend.encode_batch(texts[i:i + batch], add_special_tokens=False):
            ids = enc.ids
            # A literal special-token string inside a document would be encoded as the special id;
            # MASK must never be trained and EOS must only mark document ends, so such docs are dropped.
            if mask in ids or eos in ids:
                continue
            parts.append(np.asarray(ids + [eos], dtype=np.int32))
    if not parts:
        return np.zeros(0, dtype=np.int32)
    return np.concatenate(parts)


class MixedWindows(IterableDataset):
    """Endless random windows of `seq_len` tokens; each window is code with probability `code_share`."""

    def __init__(self, streams: dict[str, np.ndarray], seq_len: int, code_share: float, seed: int):
        for name, s in streams.items():
            if len(s) <= seq_len:       # (a window starts anywhere before the last seq_len tokens)
                raise UserError(f"the {name} training text has {len(s)} tokens, and random windows of data.seq_len "
                                f"{seq_len} need more: lower data.seq_len or give the recipe more {name} data")
        self.streams, self.seq_len, self.code_share, self.seed = streams, seq_len, code_share, seed

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        rng = np.random.default_rng([self.seed, info.id if info else 0])
        code, math = self.streams["code"], self.streams["math"]
        while True:
            s = code if rng.random() < self.code_share else math
            o = int(rng.integers(0, len(s) - self.seq_len))
            yield torch.from_numpy(s[o:o + self.seq_len].astype(np.int64))


class FixedWindows(Dataset):
    """The first `n` aligned windows of a held-out stream (same windows every evaluation)."""

    def __init__(self, stream: np.ndarray, seq_len: int, n: int):
        self.windows = [stream[i * seq_len:(i + 1) * seq_len] for i in range(min(n, len(stream) // seq_len))]
        if not self.windows:
            raise UserError(f"the held-out text has {len(stream)} tokens, fewer than one window of data.seq_len "
                            f"{seq_len}: lower data.seq_len or hold out more data")

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        return torch.from_numpy(self.windows[i].astype(np.int64))


class TargetLMData(pl.LightningDataModule):
    """Code + math streams for the target LM. `texts` maps (domain, split) -> iterable of documents."""

    def __init__(self, tokenizer, texts: dict[tuple[str, str], list[str]], *, seq_len: int, batch_size: int,
                 code_share: float, val_windows: int, seed: int):
        super().__init__()
        self.tokenizer, self.texts = tokenizer, texts
        self.seq_len, self.batch_size, self.code_share = seq_len, batch_size, code_share
        self.val_windows, self.seed = val_windows, seed
        self.streams: dict[tuple[str, str], np.ndarray] = {}

    def setup(self, stage: str | None = None) -> None:
        if self.streams:
            return
        for (domain, split), docs in self.texts.items():
            self.streams[domain, split] = token_stream(self.tokenizer, docs, f"{domain}/{split}")

    def stream_tokens(self) -> dict[str, int]:
        return {f"{d}/{s}": int(len(a)) for (d, s), a in self.streams.items()}

    def train_dataloader(self):
        ds = MixedWindows({d: self.streams[d, "train"] for d in DOMAINS}, self.seq_len, self.code_share, self.seed)
        return DataLoader(ds, batch_size=self.batch_size, num_workers=0)

    def val_dataloader(self):
        # order matches DOMAINS, which the LightningModule uses to name the per-domain losses
        return [DataLoader(FixedWindows(self.streams[d, "heldout"], self.seq_len, self.val_windows),
                           batch_size=self.batch_size) for d in DOMAINS]
