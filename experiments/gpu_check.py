"""Check a GPU (or, with --device cpu, any machine) for domino-lab: bf16 training steps, lossless speculative
decoding, and throughput — one table at the end; exit code 1 if a check failed.

    python experiments/gpu_check.py                                   # embedded default target, cuda if present
    python experiments/gpu_check.py --device cpu --quick               # the CPU fallback (about 2 min on 2 cores)
    python experiments/gpu_check.py --target Qwen/Qwen3-8B --drafter runs/train/qwen3-8b-domino/best --prompts 16

1. bf16 training: `domino_lab.train.train()` (the real Lightning path) for --steps steps with precision
   bf16-mixed on the device, on data the target regenerates first (math prompts, in a temp folder); checks that
   every logged loss is finite and reports ms per step.
2. Losslessness: greedy speculative decoding must give exactly the tokens of plain decoding (and of Hugging Face
   `generate`). Checked in float32, where it must hold bit for bit (PASS/FAIL), and in bfloat16 on the GPU, where
   a verify forward over a block and a one-token forward round differently, so a near-tie can flip an argmax:
   reported as a count (a difference there is a numerics note, not a failed check).
3. Throughput: an interleaved, warmed-up `domino_lab.bench` run of plain decoding (ar), HF generate and the
   drafters in the working dtype (bfloat16 on GPU): τ, tokens/s, speedup over ar.

The default drafters are the shipped `default` (Domino) and `default-dflash` for the embedded target; for another
target pass --drafter (a trained checkpoint), else an untrained Domino drafter checks losslessness only (its τ
is about 1, so its throughput says nothing).
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse_args(argv):
    from domino_lab.errors import CliParser

    p = CliParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto",
                   help="auto (cuda if available), cuda, cpu; pick a GPU with CUDA_VISIBLE_DEVICES")
    p.add_argument("--target", default="default", help="HF id, local model dir, or default (embedded)")
    p.add_argument("--drafter", action="append", default=None,
                   help="drafter(s) to check: checkpoint dir or shipped name (repeatable); default: the shipped "
                        "ones for the embedded target, else untrained:domino")
    p.add_argument("--prompts", type=int, default=8, help="math eval prompts for losslessness and throughput")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--steps", type=int, default=30, help="bf16 training steps")
    p.add_argument("--train-prompts", type=int, default=64, help="prompts the target regenerates for training")
    p.add_argument("--train-override", action="append", default=[], metavar="KEY=VALUE",
                   help="TrainConfig override for the training check (e.g. drafter.num_layers=5)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--quick", action="store_true", help="short settings: 4 prompts x 32 tokens, 8 training steps")
    p.add_argument("--skip", nargs="*", default=[], choices=["train", "lossless", "throughput"])
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.max_new_tokens = min(args.prompts, 4), min(args.max_new_tokens, 32)
        args.steps, args.train_prompts = min(args.steps, 8), min(args.train_prompts, 24)
    return args


class Table:
    def __init__(self):
        self.rows: list[tuple[str, str, str, str]] = []

    def add(self, check: str, setting: str, result: str, verdict: str = ""):
        self.rows.append((check, setting, result, verdict))
        print(f"[gpu_check] {check}: {result} {verdict}".rstrip(), file=sys.stderr, flush=True)

    def render(self) -> str:
        head = ("check", "setting", "result", "verdict")
        widths = [max(len(r[i]) for r in self.rows + [head]) for i in range(4)]
        line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"   # noqa: E731
        return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in self.rows])

    @property
    def failed(self) -> bool:
        return any(r[3] == "FAIL" for r in self.rows)


def resolve_device(spec: str):
    import torch

    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda" and dev.index not in (None, 0):
        raise SystemExit(f"error: --device {spec}: use CUDA_VISIBLE_DEVICES={dev.index} with --device cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch sees no CUDA device "
                         f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); try --device cpu")
    return dev


def describe_device(dev) -> str:
    import torch

    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        return (f"{props.name}, {props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}, "
                f"bf16 {'yes' if torch.cuda.is_bf16_supported() else 'NO'}")
    from domino_lab.target import cpu_description

    return f"CPU {cpu_description()}, {torch.get_num_threads()} threads"


def sync(dev):
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def check_training(args, dev, table: Table, work: Path) -> None:
    import lightning.pytorch as pl
    import torch
    from mlflow.tracking import MlflowClient

    from domino_lab.config import load_config
    from domino_lab.data.regenerate import regenerate, training_prompts
    from domino_lab.target import Target
    from domino_lab.train import train
    from domino_lab.training.config import TrainConfig

    class StepTimer(pl.Callback):
        def __init__(self):
            self.times = []

        def on_train_batch_start(self, *a):
            sync(dev)
            self._t = time.perf_counter()

        def on_train_batch_end(self, *a):
            sync(dev)
            self.times.append(time.perf_counter() - self._t)

    tdtype = "bfloat16" if dev.type == "cuda" else "float32"
    target = Target.from_pretrained(args.target, dtype=tdtype, device=str(dev))
    data = work / "data"
    regenerate(target, training_prompts(args.train_prompts, 0), data, max_new_tokens=96, batch_size=16,
               progress=False, target_name=args.target)
    tracking = f"sqlite:///{work / 'mlflow.db'}"
    every = max(1, args.steps)
    ov = [f"target={args.target}", f"data.path={data}", f"max_steps={args.steps}", f"dtype={tdtype}",
          "precision=bf16-mixed", f"accelerator={'gpu' if dev.type == 'cuda' else 'cpu'}", "devices=1",
          f"out_dir={work / 'train'}", f"tracking_uri={tracking}", "experiment=gpu-check", "progress_bar=false",
          f"eval.every_n_steps={every}", f"checkpoint_every_n_steps={every}", "eval.tau_prompts=2",
          "eval.tau_max_new_tokens=16", "data.batch_size=4", "data.max_length=256", "drafter.num_layers=1",
          "drafter.block_size=8", "loss.num_anchors=16"] + list(args.train_override)
    if args.threads:
        ov.append(f"threads={args.threads}")
    cfg = load_config(TrainConfig, None, ov)
    timer = StepTimer()
    setting = (f"{args.steps} steps, bf16-mixed, batch {cfg.data.batch_size}, {cfg.drafter.num_layers} draft "
               f"layer(s), B={cfg.drafter.block_size}")
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    try:
        res = train(cfg, extra_callbacks=[timer], target=target)
    except Exception as e:   # the check reports, it does not crash
        table.add("bf16 training", setting, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}", "FAIL")
        return
    losses = [m.value for m in MlflowClient(tracking).get_metric_history(res["run_id"], "train/loss")]
    finite = bool(losses) and all(math.isfinite(v) for v in losses)
    steady = sorted(timer.times[1:] or timer.times)           # the first step pays for warm-up
    ms = 1000 * steady[len(steady) // 2] if steady else float("nan")
    mem = f", peak {torch.cuda.max_memory_allocated(dev) / 2**30:.1f} GiB" if dev.type == "cuda" else ""
    result = (f"{res['steps']} steps, {ms:.0f} ms/step (median){mem}, loss {losses[0]:.2f} -> {losses[-1]:.2f}"
              if losses else "no loss logged")
    table.add("bf16 training", setting, result, "PASS" if finite and res["steps"] == args.steps else "FAIL")


def load_drafters(args, target) -> dict:
    from domino_lab.errors import UserError
    from domino_lab.models.drafter import load_drafter

    specs = args.drafter or (["default", "default-dflash"] if args.target == "default" else ["untrained:domino"])
    out = {}
    for spec in specs:
        d = load_drafter(spec, target)
        if d.config.method in out:       # the bench names methods, not checkpoints: one drafter per method
            raise UserError(f"two {d.config.method} drafters given; pass at most one per method")
        out[d.config.method] = d
    return out


def run_bench(target, drafters: dict, prompts, args, dev):
    from domino_lab.bench import Bench, bench_set
    from domino_lab.decoding.engine import prompts_token_ids

    methods = ["ar", "hf"] + list(drafters)
    b = Bench(target, methods, drafters, max_new_tokens=args.max_new_tokens)
    ids = prompts_token_ids(target, prompts, "set math")
    sync(dev)
    return bench_set(b, prompts, ids, warmup=1, progress=False)


def check_decoding(args, dev, table: Table) -> None:
    import torch

    from domino_lab.data.eval_sets import load_eval_set
    from domino_lab.target import Target

    prompts = load_eval_set("math", limit=args.prompts)
    setting = f"{len(prompts)} math prompts x {args.max_new_tokens} tokens, greedy"
    dtypes = ["float32"] + (["bfloat16"] if dev.type == "cuda" else [])
    for dtype in dtypes:
        target = Target.from_pretrained(args.target, dtype=dtype, device=str(dev))
        drafters = load_drafters(args, target)
        res = run_bench(target, drafters, prompts, args, dev)
        if "lossless" not in args.skip:
            for m in ["hf"] + list(drafters):
                ll = res[m]["lossless"]
                same = f"{ll['equal']}/{ll['total']} prompts identical to plain decoding"
                if dtype == "float32":
                    verdict = "PASS" if ll["equal"] == ll["total"] else "FAIL"
                else:
                    verdict = "PASS" if ll["equal"] == ll["total"] else "NOTE: bf16 rounding"
                table.add(f"lossless {m}", f"{setting}, {dtype}", same, verdict)
        if "throughput" not in args.skip and dtype == dtypes[-1]:
            for m in ["ar", "hf"] + list(drafters):
                r = res[m]
                tau = f"τ {r['tau']:.2f}, " if r.get("tau") and m not in ("ar", "hf") else ""
                speed = f", {r['speedup_vs_ar']:.2f}x ar" if m != "ar" else ""
                table.add(f"throughput {m}", f"{len(prompts)} prompts, {dtype}, batch 1",
                          f"{tau}{r['tokens_per_s']:.0f} tok/s{speed}")
        del target, drafters
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def main(argv=None) -> int:
    import os
    import warnings

    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    args = parse_args(argv)
    import logging

    import torch

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = resolve_device(args.device)
    table = Table()
    table.add("device", str(dev), describe_device(dev) + f", torch {torch.__version__}")
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        if "train" not in args.skip:
            check_training(args, dev, table, Path(work))
        if not {"lossless", "throughput"} <= set(args.skip):
            check_decoding(args, dev, table)
    print(f"\n## domino-lab GPU check (target {args.target}, {time.time() - t0:.0f} s)\n")
    print(table.render())
    if dev.type == "cpu":
        print("\n(CPU run: the bf16 training check exercises CPU autocast; run on the GPU for its numbers)")
    return 1 if table.failed else 0


if __name__ == "__main__":
    from domino_lab.errors import run_cli

    run_cli(main)
