"""`python -m domino_lab.experiments run NAME [--quick]`: train (or reuse) the spec's drafters, evaluate every
variant with the real engine, write <out-dir>/NAME.md and NAME.json (tables, plots, the paper's numbers).

Where things go, from any directory: specs and recipes are the repository's; without --runs-dir the drafters go
to <repository>/runs/experiments (--quick: runs/experiments-quick), their training data to runs/regenerated and
the MLflow store to runs/mlflow.db; with --runs-dir X all of that goes under X (drafters directly in X)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..errors import CliParser, UserError, atomic_path, check_out_dir, run_cli, sigterm_stops
from ..validation import check_threads


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(prog="python -m domino_lab.experiments", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the experiments in experiments/specs/")
    add_run_arguments(sub.add_parser("run", help="run one experiment"))
    rep = sub.add_parser("report", help="re-render NAME.md from NAME.json (after editing the spec's reading)")
    rep.add_argument("name")
    rep.add_argument("--out-dir", help="where NAME.json is and NAME.md goes (default experiments/results)")
    return p


def add_run_arguments(r: argparse.ArgumentParser) -> None:
    r.add_argument("name", help="an experiment name (see `list`) or a spec .yaml")
    r.add_argument("overrides", nargs="*", default=[],
                   help="key=value applied to every training run after the spec's own, e.g. target=Qwen/Qwen3-8B "
                        "data.path=runs/regenerated/qwen3-8b (before or after the options; with --quick, a key given "
                        "here wins over --quick's own value for it)")
    r.add_argument("--quick", action="store_true",
                   help="a few training steps, 2 prompts x 8 tokens: checks the whole path in minutes (its training "
                        "values, e.g. max_steps=4 and its own small data.path, fill in every key the command line "
                        "does not set)")
    r.add_argument("--out-dir", help="where NAME.md/.json go (default experiments/results; --quick: "
                                     "<runs-dir>/results)")
    r.add_argument("--runs-dir", help="trained drafters, shared by experiments, with their training data and MLflow "
                                      "store (default runs/experiments, data and store in runs/; --quick: "
                                      "runs/experiments-quick)")
    r.add_argument("--tracking-uri", help="MLflow tracking URI for the training runs (default "
                                          "sqlite:///<runs folder>/mlflow.db)")
    r.add_argument("--threads", type=int, default=None,
                   help="torch threads, >= 1 (default: all cores for training; for decoding with a small CPU target 1 "
                        "or all cores, whichever measures faster, docs/design.md#threads-for-small-targets)")
    r.add_argument("--no-progress", action="store_true")


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; `run`'s overrides may come before or after its options (`run NAME --runs-dir D
    target=X`), as for train and sweep. argparse cannot parse a command with subcommands intermixed, so `run` is
    parsed by a parser of its own."""
    words = sys.argv[1:] if argv is None else list(argv)
    if words[:1] != ["run"]:
        return build_parser().parse_args(words)
    r = CliParser(prog="python -m domino_lab.experiments run", description="run one experiment")
    add_run_arguments(r)
    args = r.parse_intermixed_args(words[1:])
    args.cmd = "run"
    return args


def results_dir() -> Path:
    """The committed result tables: the repository's experiments/results, from any directory."""
    from ..config import repo_root

    return repo_root() / "experiments" / "results"


def run_dirs(args) -> tuple[Path, Path, str]:
    """(drafters folder, runs folder for data and the MLflow store, tracking URI), all absolute. Nothing is
    created here: a bad spec or override must fail before anything exists."""
    from ..config import default_runs_dir

    if args.runs_dir:
        check_out_dir(Path(args.runs_dir).expanduser(), "--runs-dir")      # (before the tracking URI under it)
        runs_dir = root = Path(args.runs_dir).expanduser().resolve()
    else:
        root = default_runs_dir()
        runs_dir = root / ("experiments-quick" if args.quick else "experiments")
    return runs_dir, root, args.tracking_uri or f"sqlite:///{root / 'mlflow.db'}"


def check_writable(out_dir: Path) -> None:
    """--out-dir can be created and written, checked without creating it (errors.check_out_dir)."""
    check_out_dir(out_dir, "--out-dir")


def run(args) -> dict:
    import torch

    from .curves import loss_history, plot_loss_curves
    from ..data.eval_sets import prompts_digest
    from .measure import eval_prompts, head_overheads, measure
    from .report import markdown
    from .spec import load_spec
    from .training import QUICK_TRAIN, resolve_runs, train_runs

    spec = load_spec(args.name)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    quick = args.quick
    runs_dir, runs_root, tracking_uri = run_dirs(args)
    out_dir = Path(args.out_dir) if args.out_dir else (runs_dir / "results" if quick else results_dir())
    if quick:
        spec.seeds = spec.seeds[:1]
        for r in spec.runs:
            r.seeds = r.seeds[:1] if r.seeds else None
    resolved = resolve_runs(spec, runs_dir, quick, tracking_uri, args.overrides, runs_root=runs_root)
    check_writable(out_dir)      # created only when the results are written, so a failed run leaves no empty one
    t0 = time.time()
    before = {p.parent.name for p in runs_dir.glob("*/result.json")}
    trained = train_runs(resolved, runs_dir, quick, runs_root=runs_root)
    sets = eval_prompts(spec, quick)
    results = measure(spec, trained, sets, quick, progress=not args.no_progress, threads=args.threads)
    extras: dict = {}
    if "head_overhead" in spec.extras:
        extras["head_overhead"] = head_overheads(spec, trained)
    if "base_loss" in spec.extras:
        curves = {}
        for v in spec.variants:
            ids = [t.run_id for (name, _), t in trained.items() if name == v.run and t.run_id]
            if ids and v.run not in curves:
                curves[v.run] = dict(loss_history(ids, tracking_uri=tracking_uri), n_runs=len(ids))
        png = f"{spec.name}_base_loss.png"
        plot_loss_curves(curves, out_dir / png, "Base-logit loss during training (mean over seeds)",
                         "CE of the base (backbone) logits, running mean of 25", skip_steps=2 if quick else 50)
        extras["base_loss"] = {"curves": curves, "png": png}
    after = {p.parent.name for p in runs_dir.glob("*/result.json")}
    from ..target import machine_line
    from .measure import QUICK_EVAL
    meta = {"command": "python -m domino_lab.experiments run " + " ".join(sys.argv[2:] if args.argv is None
                                                                          else args.argv[1:]),
            "machine": machine_line(), "prompts": {name: prompts_digest(p) for name, p in sets.items()},
            "date": time.strftime("%Y-%m-%d %H:%M"), "wall_min": round((time.time() - t0) / 60, 1),
            "trained": sorted(after - before) or "none (all reused)", "quick": quick,
            "seeds": spec.seeds, "limit": QUICK_EVAL["limit"] if quick else spec.limit,
            "max_new_tokens": QUICK_EVAL["max_new_tokens"] if quick else spec.max_new_tokens,
            "quick_train_overrides": QUICK_TRAIN if quick else None,
            "runs": {f"{k[0]}-s{k[1]}": t.path for k, t in trained.items()},
            "run_configs": {f"{k[0]}-s{k[1]}": t.config for k, t in trained.items()}}
    md = markdown(spec, results, trained, extras, meta)
    # write both files only once everything is measured: a failed run leaves the previous results intact
    _write(out_dir, {f"{spec.name}.json": json.dumps({"meta": meta, "results": results, "extras": extras}, indent=1),
                     f"{spec.name}.md": md})
    print(md)
    return {"meta": meta, "results": results, "extras": extras}


def _write(out_dir: Path, files: dict) -> None:
    for name, text in files.items():
        with atomic_path(out_dir / name) as tmp:
            tmp.write_text(text)


def report(args) -> None:
    """Re-render NAME.md from NAME.json and the spec (e.g. after writing the spec's `reading`); measures nothing."""
    from .report import markdown
    from .spec import load_spec
    from .training import TrainedRun

    spec = load_spec(args.name)
    out_dir = Path(args.out_dir) if args.out_dir else results_dir()
    path = out_dir / f"{spec.name}.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {path} ({e}); run `python -m domino_lab.experiments run {args.name}` first") \
            from None
    try:
        # the file is input here: one that `run` did not write (emptied, edited, another tool's) is one error line
        meta, configs = data["meta"], data["meta"].get("run_configs", {})
        trained = {}
        for key, path_ in meta["runs"].items():
            name, seed = key.rsplit("-s", 1)
            trained[(name, int(seed))] = TrainedRun(name, int(seed), path_, None, None, configs.get(key, {}))
        md = markdown(spec, data["results"], trained, data["extras"], meta)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, StopIteration) as e:
        raise UserError(f"{path} is not the results file `python -m domino_lab.experiments run {args.name}` writes "
                        f"({type(e).__name__}: {e}); run the experiment again to write it") from None
    _write(out_dir, {f"{spec.name}.md": md})
    print(md)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cmd == "list":
        from .spec import available, load_spec
        for n in available():
            print(f"{n:20s} {load_spec(n).title}")
        return 0
    if args.cmd == "report":
        report(args)
        return 0
    if args.threads is not None:      # before anything runs: decoding, after every run is trained, would refuse it
        check_threads(args.threads)
    args.argv = argv
    with sigterm_stops("training", "run the same command again to continue (finished runs are reused, the "
                       "interrupted one resumes from its last checkpoint if it wrote one)"):
        run(args)
    return 0


if __name__ == "__main__":
    run_cli(main)
