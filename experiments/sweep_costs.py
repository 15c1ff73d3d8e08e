"""How steady is a sweep trial's cost measurement? The same trained drafters timed several times, two ways.

    python experiments/sweep_costs.py --sweep-dir runs/sweep-fresh/domino-default --trials 0 1 6 7 --repeats 3
    python experiments/sweep_costs.py --sweep-dir DIR --trials 0 --repeats 1 --quick --out /tmp/sc   (tests)

- **decode**: what the sweep used before: draft and verify ms of one validation prompt decoded alone (the first of
  `measure_tau`'s prompts), at the trial process's thread count, and a plain step from 3 prompts decoded without a
  drafter right after it (the sweep measured the plain step once, at the study's start).
- **step_costs**: draft step, verify forward and plain forward run in turn on one context, medians
  (domino_lab/experiments/timing.py), which the sweep uses now.

Each repeat times every trial both ways, in turn, so both see the same machine; the spread of one drafter's speedup
estimate (τ × plain ÷ (draft + verify)) over repeats is the measurement's noise.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from domino_lab.config import load_config
from domino_lab.decoding import speculative_generate
from domino_lab.decoding.metrics import StepTally, speedup_bound
from domino_lab.errors import CliParser, UserError, atomic_path, check_out_dir, run_cli
from domino_lab.experiments.timing import step_costs
from domino_lab.models import Drafter
from domino_lab.target import Target, cpu_line
from domino_lab.training.config import TrainConfig
from domino_lab.training.datamodule import DrafterDataModule


def decode_costs(target, d, prompts) -> dict:
    """The old way, at the trial process's threads: one prompt decoded with the drafter (64 new tokens), three
    without (32)."""
    spec = StepTally().add(speculative_generate(target, d, prompt_ids=prompts[0], max_new_tokens=64).steps)
    plain = StepTally()
    for p in prompts[:3]:
        plain.add(speculative_generate(target, None, prompt_ids=p, max_new_tokens=32).steps)
    return {"draft_ms": spec.draft_ms, "verify_ms": spec.verify_ms, "step_ms": plain.verify_ms}


def main(argv=None) -> int:
    ap = CliParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep-dir", required=True, help="a finished sweep's study folder (trial_NNNN/best inside)")
    ap.add_argument("--trials", type=int, nargs="+", required=True)
    ap.add_argument("--target", default="default", help="the sweep's target (name or folder)")
    ap.add_argument("--data", help="the sweep's regenerated data (default: SWEEP_DIR/../regenerated/sweep-default)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2,
                    help="torch threads of the trial process (the recipes' threads: 2); step_costs uses decoding's")
    ap.add_argument("--quick", action="store_true", help="fewer timed steps (tests)")
    ap.add_argument("--out", default="experiments/results/sweep_costs")
    args = ap.parse_args(argv)
    check_out_dir(args.out)
    sdir = Path(args.sweep_dir)
    summary = sdir / "summary.json"
    if not summary.is_file():
        raise UserError(f"{sdir} has no summary.json; give a finished sweep's study folder (--sweep-dir)")
    rows = {t["trial"]: t for t in json.loads(summary.read_text())["trials"]}
    missing = [n for n in args.trials if n not in rows or not rows[n].get("best_dir")]
    if missing:
        raise UserError(f"trials {missing} have no trained drafter in {sdir}; choose among {sorted(rows)}")
    data = Path(args.data) if args.data else sdir.parent / "regenerated" / "sweep-default"
    if not (data / "meta.json").is_file():
        raise UserError(f"no regenerated dataset at {data}; give the sweep's data folder with --data")
    torch.set_num_threads(args.threads)
    target = Target.from_pretrained(args.target)
    ds = {n: Drafter.from_pretrained(rows[n]["best_dir"], target).eval() for n in args.trials}
    # the sweep's validation prompts (its data.val_fraction and max_length): the old way timed the first of them
    cfg = load_config(TrainConfig, "experiments/configs/domino.yaml",
                      [f"data.path={data}", "data.val_fraction=0.2", "data.max_length=256"])
    dm = DrafterDataModule(cfg.data, seed=0)
    dm.setup()
    prompts = dm.tau_prompts(3)
    reps = 2 if args.quick else 20
    res: dict = {n: {"decode": [], "step_costs": []} for n in args.trials}
    t0 = time.perf_counter()
    for _ in range(args.repeats):
        for n, d in ds.items():
            tau = rows[n]["values"][0]
            for way, c in (("decode", decode_costs(target, d, prompts)),
                           ("step_costs", step_costs(target, d, reps=reps))):
                res[n][way].append(c | {"speedup_est": speedup_bound(tau, c["step_ms"], c["draft_ms"], c["verify_ms"])})
    meta = {"command": "python experiments/sweep_costs.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": f"{cpu_line()}, torch {torch.__version__}, "
                       f"{args.threads} torch threads (decode way)",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seconds": round(time.perf_counter() - t0, 1)}
    lines = ["# Sweep trial costs: one drafter timed again and again", "", f"`{meta['command']}`", "",
             f"{meta['machine']}; {meta['date']}; {meta['seconds']} s. Speedup est. = τ × plain ÷ (draft + verify); "
             "each repeat times every trial both ways in turn.", "",
             "| trial | τ | way | draft ms | verify ms | plain ms | speedup est. per repeat | spread (max ÷ min) |",
             "|---|---|---|---|---|---|---|---|"]
    for n in args.trials:
        for way in ("decode", "step_costs"):
            cs = res[n][way]
            est = [c["speedup_est"] for c in cs]
            med = {k: statistics.median(c[k] for c in cs) for k in ("draft_ms", "verify_ms", "step_ms")}
            lines.append(f"| {n} | {rows[n]['values'][0]:.3f} | {way} | {med['draft_ms']:.2f} | {med['verify_ms']:.2f} | "
                         f"{med['step_ms']:.2f} | {' '.join(f'{e:.2f}' for e in est)} | {max(est) / min(est):.2f} |")
    out = Path(args.out)
    with atomic_path(out / "sweep_costs.md") as tmp:
        tmp.write_text("\n".join(lines) + "\n")
    with atomic_path(out / "sweep_costs.json") as tmp:
        tmp.write_text(json.dumps({"meta": meta, "results": {str(k): v for k, v in res.items()}}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    run_cli(main)
