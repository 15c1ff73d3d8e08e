"""What offline target features buy: one drafter training step (forward, loss, backward, optimiser step) with the
target's features computed inside the step (online) vs read from the memory-mapped cache (offline), same batches,
interleaved rounds, median wall time per step.

    python -m domino_lab.regenerate --target default --out runs/regenerated/bench-200 --n-math 100 --n-code 100
    python experiments/train_step_bench.py --data runs/regenerated/bench-200 --out experiments/results/train_step.md
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from domino_lab.config import load_config, repo_root
from domino_lab.data.features import ensure
from domino_lab.errors import atomic_path, run_cli
from domino_lab.target import Target
from domino_lab.training.config import TrainConfig, drafter_config
from domino_lab.training.datamodule import DrafterDataModule
from domino_lab.training.module import DrafterModule
from domino_lab.training.objective import weighted_ce


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="experiments/configs/domino.yaml")
    p.add_argument("--data", required=True, help="a regenerated dataset of the recipe's target")
    p.add_argument("--features-dir", default=None, help="cache folder (default: <runs>/features)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per mode per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="markdown result (default: print only)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    over = [f"data.path={a.data}"] + ([f"data.features_dir={a.features_dir}"] if a.features_dir else [])
    cfg = load_config(TrainConfig, a.config, over)
    target = Target.from_pretrained(cfg.target, dtype=cfg.dtype)
    dcfg = drafter_config(cfg.drafter, target)
    dm = DrafterDataModule(cfg.data, seed=cfg.seed)
    dm.setup("fit")
    t0 = time.perf_counter()
    cache = ensure(target, dm.train_rows + dm.val_rows, dcfg.target_layer_ids, cfg.data.features_dir)
    build_s = time.perf_counter() - t0
    online = list(iter(dm.train_dataloader()))[: a.steps]
    dm.features = cache
    offline = list(iter(dm.train_dataloader()))[: a.steps]
    module = DrafterModule(cfg, dcfg, target)
    module._anchor_gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(module.drafter.parameters(), lr=1e-4)
    gamma = module.gamma

    def step(batch):
        bb = module._blocks(batch, cfg.loss.prefix_mode)
        loss = 0.5 * weighted_ce(bb.logits_base, bb.labels, bb.valid, gamma) + \
            0.5 * weighted_ce(bb.logits_final, bb.labels, bb.valid, gamma)
        opt.zero_grad()
        loss.backward()
        opt.step()

    times = {"online": [], "offline": []}
    for b in online[:2] + offline[:2]:          # warm-up
        step(b)
    for r in range(a.rounds):
        for mode in (["online", "offline"] if r % 2 == 0 else ["offline", "online"]):
            for b in (online if mode == "online" else offline):
                t = time.perf_counter()
                step(b)
                times[mode].append(time.perf_counter() - t)
    med = {m: 1000 * statistics.median(v) for m, v in times.items()}
    tokens = sum(len(r["input_ids"]) for r in dm.train_rows + dm.val_rows)
    size_mb = sum(f.stat().st_size for f in cache.path.glob("*.safetensors")) / 2**20
    cmd = "python experiments/train_step_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        "# Offline target features: training step time", "",
        f"`{cmd}`", "",
        f"Machine: {platform.machine()}, {a.threads} torch threads, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}. Recipe `{a.config}` (batch {cfg.data.batch_size} × ≤ {cfg.data.max_length} "
        f"tokens, {cfg.loss.num_anchors} anchors, taps {dcfg.target_layer_ids}); {a.rounds} interleaved rounds × "
        f"{a.steps} steps per mode, median.", "",
        "| features | ms per step | × offline |", "|---|---|---|",
        f"| online (the target's decoder inside every step) | {med['online']:.1f} | {med['online'] / med['offline']:.2f}× |",
        f"| offline (memory-mapped fp16 cache) | {med['offline']:.1f} | 1.00× |", "",
        f"Cache: {len(cache)} sequences, {tokens:,} tokens, {size_mb:.0f} MB on disk "
        f"({2 * cache.width} bytes per token), built in {build_s:.1f} s (0 s when it already existed).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        out = Path(a.out)
        out = out if out.is_absolute() else repo_root() / out
        with atomic_path(out) as t:
            t.write_text(text)
    return 0


if __name__ == "__main__":
    run_cli(main)
