"""Train the shipped default drafters and the curriculum ablation on the embedded target, over several seeds.

    python experiments/train_default_drafters.py --seeds 0 1 2 --parallel 2 --ship

One `python -m domino_lab.train` process per (recipe, seed), all with the same regenerated data, steps and
seeds; `--parallel 2` runs two at a time with one torch thread each (2 cores). Finished runs (result.json)
are skipped, so rerunning after an interruption continues. `--ship` copies seed 0's best-by-val/τ drafters
of each recipe to domino_lab/assets (SHIP below). The shipped drafters come in two stages:

    python experiments/train_default_drafters.py --recipes domino_copy dflash_copy eagle --seeds 0 \
        --runs-dir runs/long4k --ship max_steps=4000                 # stage 1: default-mc, default-dflash-mc, ...
    python experiments/train_default_drafters.py --recipes domino_prose dflash_prose eagle_prose --seeds 0 \
        --runs-dir runs/prose-ship --ship                          # stage 2: default, default-dflash, default-eagle

Stage 2 starts from stage 1's shipped drafters (the recipes' drafter.init_from) and keeps their FR-Spec lists;
`domino` and `dflash` ship as `default-nocopy` and `default-dflash-nocopy`. Writes
experiments/results/drafters_training.{md,json} and a plot of the base loss with and without the curriculum (the
paper's ablation, its Figure 3 in kind).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from domino_lab.errors import CliParser, UserError, check_out_dir, run_cli
from domino_lab.experiments.curves import convergence_curves, loss_history, plot_convergence, plot_loss_curves
from domino_lab.target import cpu_line

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "experiments" / "configs"
RESULTS = ROOT / "experiments" / "results"
# recipe -> (asset folder, the name it ships under (models/drafter.py#SHIPPED_DRAFTERS), where its results are)
STAGE1, STAGE2 = "experiments/results/drafters*.md", "experiments/results/prose_data.md"
SHIP = {"domino": ("drafter-domino", "default-nocopy", STAGE1),
        "dflash": ("drafter-dflash", "default-dflash-nocopy", STAGE1),
        "eagle": ("drafter-eagle", "default-eagle-mc", STAGE1),
        "domino_copy": ("drafter-domino-copy", "default-mc", STAGE1),
        "dflash_copy": ("drafter-dflash-copy", "default-dflash-mc", STAGE1),
        # stage 2: the `*-mc` drafters above, fine-tuned with prose in the data (docs/design.md#prose-domain)
        "domino_prose": ("drafter-domino-prose", "default", STAGE2),
        "dflash_prose": ("drafter-dflash-prose", "default-dflash", STAGE2),
        "eagle_prose": ("drafter-eagle-prose", "default-eagle", STAGE2)}


def run_dir(runs: Path, recipe: str, seed: int) -> Path:
    return runs / f"{recipe}-s{seed}"


def launch(recipe: str, seed: int, runs: Path, threads: int, overrides: list[str]) -> subprocess.Popen:
    out = run_dir(runs, recipe, seed)
    out.mkdir(parents=True, exist_ok=True)
    resume = ["--resume"] if (out / "checkpoints").is_dir() and any((out / "checkpoints").glob("*.ckpt")) else []
    cmd = [sys.executable, "-m", "domino_lab.train", "--config", str(CONFIGS / f"{recipe}.yaml"), *resume,
           f"seed={seed}", f"out_dir={out}", f"run_name={recipe}-s{seed}", f"threads={threads}",
           "progress_bar=false", "experiment=default-drafters", *overrides]
    log = open(out / "train.log", "a")
    print(f"[start] {recipe} seed {seed}: {' '.join(cmd[1:])}", file=sys.stderr)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    proc.started, proc.job, proc.logfile = time.time(), (recipe, seed), log
    return proc


def train_all(recipes, seeds, runs: Path, parallel: int, overrides) -> dict:
    todo = [(r, s) for s in seeds for r in recipes if not (run_dir(runs, r, s) / "result.json").exists()]
    threads = max(1, 2 // parallel) if parallel <= 2 else 1
    walls: dict = {}
    live: list = []
    while todo or live:
        while todo and len(live) < parallel:
            live.append(launch(*todo.pop(0), runs, threads, overrides))
        time.sleep(2)
        for p in list(live):
            if p.poll() is None:
                continue
            live.remove(p)
            p.logfile.close()
            walls[p.job] = time.time() - p.started
            if p.returncode != 0:
                for q in live:
                    q.terminate()
                tail = (run_dir(runs, *p.job) / "train.log").read_text().strip().splitlines()[-1:]
                raise UserError(f"training {p.job[0]} seed {p.job[1]} failed (exit {p.returncode}): "
                                f"{tail[0] if tail else '?'}; see {run_dir(runs, *p.job) / 'train.log'}")
            print(f"[done] {p.job[0]} seed {p.job[1]} in {walls[p.job] / 60:.1f} min", file=sys.stderr)
    return walls


def base_loss_curves(runs: Path, recipes, seeds) -> dict:
    """train/loss_base per step from each run's MLflow history (mean over seeds)."""
    out = {}
    for r in recipes:
        ids = [json.loads((run_dir(runs, r, s) / "mlflow_run.json").read_text())["run_id"] for s in seeds]
        c = loss_history(ids)
        out[r] = {"steps": c["steps"], "loss_base": c["values"]}
    return out


def _wall_min(client, run_id: str) -> float | None:
    info = client.get_run(run_id).info          # the MLflow run spans the whole training process
    return round((info.end_time - info.start_time) / 60000, 1) if info.end_time else None


def plot_curves(curves: dict, out_png: Path) -> None:
    plot_loss_curves({r: {"steps": c["steps"], "values": c["loss_base"]} for r, c in curves.items()}, out_png,
                     "Base loss with and without the base-anchored curriculum",
                     "CE of the base (backbone) logits, running mean of 25")


def ship(args, argv) -> None:
    """Copy seed 0's best drafters into domino_lab/assets, each drafting over the FR-Spec list of its training
    data's --frspec-k most frequent response tokens (the weights are unchanged: `--full-vocab` drafts over all)."""
    from domino_lab import Target
    from domino_lab.config import load_config
    from domino_lab.models import load_drafter
    from domino_lab.models.frspec import frequent_tokens, restrict
    from domino_lab.training.config import TrainConfig
    from domino_lab.training.datamodule import DrafterDataModule

    target = Target.from_pretrained("default", dtype="float32")
    command = "python experiments/train_default_drafters.py " + " ".join(argv if argv is not None else sys.argv[1:])
    for method, (asset, name, results) in SHIP.items():
        src = run_dir(Path(args.runs_dir), method, args.seeds[0])
        if method not in args.recipes or not (src / "best").is_dir():
            continue
        res = json.loads((src / "result.json").read_text())
        cfg = load_config(TrainConfig, str(CONFIGS / f"{method}.yaml"), [f"seed={args.seeds[0]}"])
        d = load_drafter(str(src / "best"), target)
        note = ""
        if d.config.frspec_k:         # warm-started from a drafter that had a list: it trained with that one
            note = f" It drafts over the FR-Spec list of {d.config.frspec_k} tokens it was warm-started with"
        elif args.frspec_k:
            dm = DrafterDataModule(cfg.data, seed=cfg.seed)
            dm.setup("fit")           # the list comes from the training split, as in training with frspec_k
            d = restrict(d, frequent_tokens(dm.train_rows, args.frspec_k, d.config.vocab_size))
            note = (f" It drafts over FR-Spec's {args.frspec_k} most frequent response tokens of the training "
                    f"split of `{os.path.relpath(cfg.data.path, ROOT)}`")
        if note:
            note += " (verification always scores the whole vocabulary; `--full-vocab` drafts over all of it)."
        dst = ROOT / "domino_lab" / "assets" / asset
        d.save_pretrained(dst)
        (dst / "README.md").write_text(
            f"# `{name}` drafter ({method})\n\n"
            f"Trained on the embedded default target with recipe `experiments/configs/{method}.yaml`, seed "
            f"{args.seeds[0]}, {res['steps']} steps"
            + (f" from the shipped `{cfg.drafter.init_from}`" if cfg.drafter.init_from else "")
            + " (`python experiments/train_default_drafters.py` trains the "
            f"recipes; run folder `{src.name}`); shipped by "
            f"`{command}` "
            f"at the best validation τ ({res['best_tau']:.3f} on the recipe's validation prompts).{note} Results "
            f"over seeds and eval sets: `{results}`.\n")
        print(f"[ship] {src / 'best'} -> {dst}", file=sys.stderr)


def main(argv=None) -> int:
    p = CliParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", nargs="+", default=["domino", "dflash", "domino_no_curriculum"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--parallel", type=int, default=2, help="training processes at once (2 cores: 2 x 1 thread)")
    p.add_argument("--runs-dir", default="runs/default-drafters")
    p.add_argument("--ship", action="store_true", help="copy seed 0's domino/dflash/eagle to domino_lab/assets")
    p.add_argument("--frspec-k", type=int, default=1024,
                   help="shipped drafters draft over this many most frequent response tokens (0 = all)")
    p.add_argument("--ship-only", action="store_true", help="ship finished runs; no training, no summary")
    p.add_argument("overrides", nargs="*", help="key=value applied to every recipe (e.g. max_steps=600)")
    args = p.parse_args(argv)
    for r in args.recipes:
        if not (CONFIGS / f"{r}.yaml").exists():
            raise UserError(f"no recipe experiments/configs/{r}.yaml")
    if args.parallel < 1:
        raise UserError("--parallel must be at least 1")
    runs = check_out_dir(args.runs_dir, "--runs-dir")
    if args.ship_only:
        ship(args, argv)
        return 0
    started = time.time()
    train_all(args.recipes, args.seeds, runs, args.parallel, args.overrides)

    # the summary covers every finished run in the folder (earlier invocations' too)
    from mlflow.tracking import MlflowClient

    from domino_lab.training.tracking import default_tracking_uri

    client = MlflowClient(default_tracking_uri())
    rows, done = [], {}
    for f in sorted(runs.glob("*-s*/result.json")):
        r, s = f.parent.name.rsplit("-s", 1)
        res = json.loads(f.read_text())
        done.setdefault(r, set()).add(int(s))
        rows.append({"recipe": r, "seed": int(s), "steps": res["steps"], "best_val_tau": res["best_tau"],
                     "wall_min": _wall_min(client, res["run_id"]),
                     "best_dir": res["best_dir"]})
    domino_recipes = [r for r in done if r.startswith("domino")]
    common = sorted(set.intersection(*(done[r] for r in domino_recipes))) if domino_recipes else []
    curves = base_loss_curves(runs, domino_recipes, common) if common else {}
    RESULTS.mkdir(parents=True, exist_ok=True)
    plot_curves(curves, RESULTS / "curriculum_base_loss.png")
    convergence = convergence_curves({r: run_dir(runs, r, args.seeds[0]) for r in sorted(done)})
    plot_convergence(convergence, RESULTS / "drafters_convergence.png")
    if args.ship:
        ship(args, argv)
    final_base = {r: round(sum(c["loss_base"][-50:]) / len(c["loss_base"][-50:]), 4) for r, c in curves.items()}
    summary = {"command": "python experiments/train_default_drafters.py " + " ".join(argv or sys.argv[1:]),
               "machine": f"{cpu_line()}, {os.cpu_count()} CPUs, "
                          f"{args.parallel} runs at once",
               "date": time.strftime("%Y-%m-%d %H:%M"), "wall_min_total": round((time.time() - started) / 60, 1),
               "runs": rows, "final_base_loss_last50_mean_over_seeds": final_base, "convergence": convergence}
    (RESULTS / "drafters_training.json").write_text(json.dumps(summary, indent=1))
    lines = [f"`{summary['command']}` ({summary['machine']}, {summary['date']}; this invocation "
             f"{summary['wall_min_total']} min, runs finished by earlier invocations are reused and listed with their "
             "own wall time)", "",
             "| recipe | seed | steps | best val τ | wall min |", "|---|---|---|---|---|"]
    lines += [f"| {x['recipe']} | {x['seed']} | {x['steps']} | {x['best_val_tau']:.3f} | {x['wall_min'] or '–'} |"
              for x in rows]
    lines += ["", f"Base-logit CE, mean of the last 50 logged steps, averaged over seeds {common}: "
              + ", ".join(f"{r} {v}" for r, v in final_base.items()), "",
              "![base loss](curriculum_base_loss.png)", "",
              f"## Convergence (seed {args.seeds[0]}): val τ at each evaluation", "",
              "Greedy τ of real speculative decoding on the recipe's validation prompts (held-out rows of the "
              "regenerated data), and the acceptance of drafts 0-2 given the earlier ones were accepted.", ""]
    for r, c in convergence.items():
        lines += [f"**{r}**: " + ", ".join(f"step {s_ + 1}: τ {t:.2f} (draft 0 {a if a is None else round(a, 2)})"
                                           for s_, t, a in zip(c["steps"], c["tau"], c["accept"][0]))]
    lines += ["", "![convergence](drafters_convergence.png)"]
    (RESULTS / "drafters_training.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    run_cli(main)
