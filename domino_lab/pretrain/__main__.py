"""Pretrain the embedded default target, a small Qwen3 causal LM, from scratch on code + math.

    python -m domino_lab.pretrain --config experiments/configs/target.yaml [--quick] [--out DIR]

The full recipe writes `domino_lab/assets/target/` (fp16 safetensors, config, tokenizer and
`train_meta.json`) atomically; `--quick` trains a few hundred tokens of a toy shape into `--out` (or a
temporary folder) for tests and never touches the shipped asset.

The learning-rate schedule runs on a *wall-clock* budget as well as a step budget: progress is
max(step / max_steps, elapsed / max_minutes), and training stops when progress reaches 1. On a shared
2-core machine the step rate varies with other load; a step-only cosine would then either overrun
the time budget or be cut off before the learning rate has decayed. The steps actually taken are
recorded in train_meta.json.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from ..config import default_runs_dir
from ..errors import CliParser, UserError, check_out_dir, run_cli
from .recipe import DEFAULT_CONFIG, SHIPPED_DIR, apply_quick, load_recipe
from .train import check_export_dir


def main(argv: list[str] | None = None) -> int:
    ap = CliParser(prog="python -m domino_lab.pretrain", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=DEFAULT_CONFIG, help="recipe YAML (default: %(default)s)")
    ap.add_argument("--quick", action="store_true", help="toy shape, a few hundred tokens; for tests")
    ap.add_argument("--out", help=f"output folder (default: {SHIPPED_DIR} for the full recipe, a temp folder for --quick)")
    ap.add_argument("--runs-dir", default=None, help="Lightning CSV logs and checkpoints, and the runs/ folder of "
                                                     "the recipe's paths (default: <repository>/runs)")
    ap.add_argument("--cache-dir", default=None, help="dataset/tokenizer cache (default: $DOMINO_LAB_CACHE or ~/.cache/domino_lab)")
    args = ap.parse_args(argv)

    # every place written to is checked before anything is created or trained
    if args.runs_dir is not None:
        check_out_dir(args.runs_dir, "--runs-dir")
    recipe = load_recipe(args.config, runs_dir=args.runs_dir)
    if args.quick:
        recipe = apply_quick(recipe)
        if args.out:
            check_export_dir(args.out)
            if Path(args.out).resolve() == SHIPPED_DIR.resolve():
                raise UserError("--quick must not overwrite the shipped target; pass another --out")
    else:
        out = check_export_dir(args.out or recipe.out_dir or SHIPPED_DIR, "--out" if args.out else "out_dir")
    from ..data.cache import cache_root

    cache_root(args.cache_dir)  # an unwritable cache is a user error: say so before any slow work
    if args.quick:
        out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="domino-target-quick-"))
        runs = Path(args.runs_dir) if args.runs_dir else out.parent / f".{out.name}-runs"
    else:
        runs = Path(args.runs_dir) if args.runs_dir else default_runs_dir()
    from .train import train

    meta = train(recipe, out, runs, cache_dir=args.cache_dir, quick=args.quick)
    print(json.dumps({"out": str(out), **{k: meta[k] for k in ("parameters", "tokens_seen", "steps",
                                                               "train_wall_time_s", "val_loss_code",
                                                               "val_loss_math")}}))
    return 0


if __name__ == "__main__":
    run_cli(main)
