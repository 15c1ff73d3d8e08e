"""Has a training run converged? Validation τ and the first drafts' acceptance at every evaluation of several runs,
side by side, from their MLflow histories (a run folder is what `python -m domino_lab.train` writes: its
mlflow_run.json names the run).

    python experiments/convergence.py --run dflash_copy=runs/ship/dflash_copy-s0 \\
        --run dflash_copy-4k=runs/long/dflash_copy-4k-s0 --out experiments/results/long_training

writes <out>.md (a table: val τ at every evaluation, the best, and the τ gained over the last quarter of the run),
<out>.json and <out>.png (domino_lab.experiments.curves.plot_convergence).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from domino_lab.errors import CliParser, UserError, atomic_path, check_out_file, run_cli
from domino_lab.experiments.curves import convergence_curves, plot_convergence
from domino_lab.target import cpu_line


def last_quarter_gain(steps: list[int], tau: list[float]) -> float | None:
    """Val τ at the last evaluation minus the best val τ of the evaluations up to 3/4 of the run: how much the
    last quarter of training still bought (≤ 0: the run had plateaued)."""
    if len(steps) < 2:
        return None
    cut = steps[-1] * 3 / 4
    early = [t for s, t in zip(steps, tau) if s <= cut]
    return tau[-1] - max(early) if early else None


def report(curves: dict, command: str) -> str:
    lines = [f"`{command}` ({cpu_line()}, {time.strftime('%Y-%m-%d %H:%M')})", "",
             "| run | steps evaluated | val τ at each evaluation | best | last − best of the first ¾ | "
             "draft 0 / 1 / 2 accepted at the end |", "|---|---|---|---|---|---|"]
    for label, c in curves.items():
        gain = last_quarter_gain(c["steps"], c["tau"])
        end = " / ".join(f"{a[-1]:.2f}" if a and a[-1] is not None else "–" for a in c["accept"])
        lines.append(f"| {label} | {', '.join(str(s + 1) for s in c['steps'])} | "
                     f"{' / '.join(f'{t:.2f}' for t in c['tau'])} | {max(c['tau']):.2f} | "
                     f"{'–' if gain is None else f'{gain:+.2f}'} | {end} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = CliParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="append", required=True, metavar="LABEL=DIR", help="a training run folder (repeat)")
    p.add_argument("--tracking-uri", default=None, help="MLflow store (default: the project's runs/mlflow.db)")
    p.add_argument("--out", required=True, help="output path without suffix (.md, .json and .png are written)")
    args = p.parse_args(argv)
    check_out_file(Path(args.out).with_suffix(".json"))
    runs = {}
    for item in args.run:
        label, sep, folder = item.partition("=")
        if not sep or not label or not folder:
            raise UserError(f"--run {item!r} must be LABEL=DIR")
        if not (Path(folder) / "mlflow_run.json").exists():
            raise UserError(f"--run {label}: {folder} holds no mlflow_run.json; give a folder written by "
                            "python -m domino_lab.train")
        runs[label] = folder
    curves = convergence_curves(runs, args.tracking_uri)
    empty = [k for k, c in curves.items() if not c["steps"]]
    if empty:
        raise UserError(f"no val/tau logged yet for {', '.join(empty)}; wait for the run's first evaluation")
    command = "python experiments/convergence.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out = Path(args.out)
    with atomic_path(out.with_suffix(".json")) as tmp:
        Path(tmp).write_text(json.dumps({"command": command, "curves": curves}, indent=1))
    plot_convergence(curves, out.with_suffix(".png"))
    text = report(curves, command)
    with atomic_path(out.with_suffix(".md")) as tmp:
        Path(tmp).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    run_cli(main)
