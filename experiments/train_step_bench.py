"""What a drafter training step (forward, loss, backward, optimiser step) costs: with the target's features
computed inside the step (online) or read from the memory-mapped cache (offline), and in float32 or under bf16
autocast (`precision=bf16-mixed`, in Lightning's own forward context; the target outside it, as in training);
same batches, interleaved rounds, median wall time per step.

    python -m domino_lab.regenerate --target default --out runs/regenerated/bench-200 --n-math 100 --n-code 100
    python experiments/train_step_bench.py --data runs/regenerated/bench-200 --out experiments/results/train_step.md
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision

from domino_lab.config import load_config, repo_root
from domino_lab.data.features import ensure
from domino_lab.errors import CliParser, atomic_path, check_out_file, run_cli
from domino_lab.target import Target, cpu_line
from domino_lab.training.config import TrainConfig, drafter_config
from domino_lab.training.datamodule import DrafterDataModule
from domino_lab.training.module import DrafterModule
from domino_lab.training.objective import weighted_ce


def main(argv=None) -> int:
    p = CliParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="experiments/configs/domino.yaml")
    p.add_argument("--data", required=True, help="a regenerated dataset of the recipe's target")
    p.add_argument("--features-dir", default=None, help="cache folder (default: <runs>/features)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per mode per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precisions", nargs="+", default=["32-true", "bf16-mixed"], choices=["32-true", "bf16-mixed"],
                   help="the first is the reference of the ratio column")
    p.add_argument("--out", default=None, help="markdown result (default: print only)")
    p.add_argument("overrides", nargs="*", help="key=value recipe overrides, as for domino_lab.train")
    a = p.parse_intermixed_args(argv)
    out = None if a.out is None else check_out_file(a.out if Path(a.out).is_absolute() else repo_root() / a.out)
    torch.set_num_threads(a.threads)
    over = [f"data.path={a.data}"] + ([f"data.features_dir={a.features_dir}"] if a.features_dir else []) + a.overrides
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

    # the forward context Lightning's Trainer runs a training step in, for each precision
    plugins = {"32-true": Precision(), "bf16-mixed": MixedPrecision("bf16-mixed", "cpu")}

    def step(batch, precision):
        with plugins[precision].forward_context():
            bb, _ = module._blocks(batch, cfg.loss.prefix_mode)
            loss = 0.5 * weighted_ce(bb.logits_base, bb.labels, bb.valid, gamma) + \
                0.5 * weighted_ce(bb.logits_final, bb.labels, bb.valid, gamma)
        opt.zero_grad()
        loss.backward()
        opt.step()

    batches = {"online": online, "offline": offline}
    modes = [(f, pr) for pr in a.precisions for f in ("online", "offline")]
    times = {m: [] for m in modes}
    for f, pr in modes:                          # warm-up
        for b in batches[f][:2]:
            step(b, pr)
    for r in range(a.rounds):
        for f, pr in (modes if r % 2 == 0 else modes[::-1]):
            for b in batches[f]:
                t = time.perf_counter()
                step(b, pr)
                times[(f, pr)].append(time.perf_counter() - t)
    med = {m: 1000 * statistics.median(v) for m, v in times.items()}
    ref = med[("offline", a.precisions[0])]
    tokens = sum(len(r["input_ids"]) for r in dm.train_rows + dm.val_rows)
    size_mb = sum(f.stat().st_size for f in cache.path.glob("*.safetensors")) / 2**20
    cmd = "python experiments/train_step_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    where = {"online": "online (the target's decoder inside every step)",
             "offline": "offline (memory-mapped fp16 cache)"}
    lines = [
        "# Drafter training step time: offline target features, mixed precision", "",
        f"`{cmd}`", "",
        f"Machine: {cpu_line()}, {a.threads} torch threads, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}. Recipe `{a.config}` (batch {cfg.data.batch_size} × ≤ {cfg.data.max_length} "
        f"tokens, {cfg.loss.num_anchors} anchors, taps {dcfg.target_layer_ids}); {a.rounds} interleaved rounds × "
        f"{a.steps} steps per mode, median.", "",
        "| features | precision | ms per step | × offline " + a.precisions[0] + " |", "|---|---|---|---|",
        *[f"| {where[f]} | {pr} | {med[(f, pr)]:.1f} | {med[(f, pr)] / ref:.2f}× |" for f, pr in modes], "",
        f"Cache: {len(cache)} sequences, {tokens:,} tokens, {size_mb:.0f} MB on disk "
        f"({2 * cache.width} bytes per token), built in {build_s:.1f} s (0 s when it already existed).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if out is not None:
        with atomic_path(out) as t:
            t.write_text(text)
    return 0


if __name__ == "__main__":
    run_cli(main)
