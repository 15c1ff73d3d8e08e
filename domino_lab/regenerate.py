"""`python -m domino_lab.regenerate`: the target writes the responses its drafter will learn from.

    python -m domino_lab.regenerate --target default --out DIR [--n-math N] [--n-code N] [--n-prose N]
        [--prompts SET_OR_JSONL] [--max-new-tokens 256] [--temperature 0] [--batch-size 16] [--seed 0]

The argument parsing only; the work (batched generation, the resumable work log, the dataset layout) is
`domino_lab.data.regenerate`.
"""
from __future__ import annotations

import json

from .errors import CliParser, UserError, run_cli
from .validation import TRAIN_SEED_MAX, check_device, check_number, check_seed, check_threads


# prompts of the training splits per domain, unless --prompts gives its own
N_DEFAULTS = {"n_math": 2000, "n_code": 2000, "n_prose": 0}


def main(argv: list[str] | None = None) -> int:
    from .data.regenerate import check_out_dir, load_meta, regenerate, training_prompts

    ap = CliParser(
        prog="python -m domino_lab.regenerate",
        description="Let the target write the responses a drafter learns from (resumable; rerun to continue).")
    ap.add_argument("--target", default="default", help="'default', a local model folder or a HF model id")
    ap.add_argument("--out", required=True, help="output folder (a datasets dataset + meta.json)")
    ap.add_argument("--n-math", type=int, default=None,
                    help=f"math prompts from the training seeds (default {N_DEFAULTS['n_math']})")
    ap.add_argument("--n-code", type=int, default=None,
                    help=f"function-header prompts from training stdlib files (default {N_DEFAULTS['n_code']})")
    ap.add_argument("--n-prose", type=int, default=None,
                    help="openings of comments and docstrings of training stdlib files (prose the target answers "
                         "with loops of its own; docs/design.md#prose-domain; default 0)")
    ap.add_argument("--prompts", default=None,
                    help="instead of the training splits, use these prompts: a JSONL file of {id, prompt} "
                         "or an eval set name (for analysis only: never train on eval prompts)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-length", type=int, default=None,
                    help="prompt + response token budget; longer prompts keep their end "
                         "(default: the target's max_position_embeddings)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (used when temperature > 0)")
    ap.add_argument("--dtype", default=None, help="float32 (default), bfloat16, float16, float64")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (pin it when several processes share the cores)")
    ap.add_argument("--cache-dir", default=None, help="corpus cache folder (default $DOMINO_LAB_CACHE)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    counts = [k for k in N_DEFAULTS if getattr(args, k) is not None]
    if args.prompts is not None and counts:
        flag = "--" + counts[0].replace("_", "-")
        raise UserError(f"{flag} counts prompts of the training splits, and --prompts replaces them with its own: "
                        f"drop {flag} or --prompts")
    for k, v in N_DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)

    # Validate everything cheap before loading a model, so bad input fails in a second.
    for flag, v, lo in (("--n-math", args.n_math, 0), ("--n-code", args.n_code, 0), ("--n-prose", args.n_prose, 0),
                        ("--max-new-tokens", args.max_new_tokens, 1), ("--batch-size", args.batch_size, 1)):
        if v < lo:
            raise UserError(f"{flag} must be at least {lo}, got {v}")
    check_number(args.temperature, "--temperature", low=0)
    if args.max_length is not None and args.max_length <= args.max_new_tokens:
        raise UserError(f"--max-length ({args.max_length}) must exceed --max-new-tokens ({args.max_new_tokens})")
    if args.threads is not None:
        check_threads(args.threads)

    check_seed(args.seed, "--seed", TRAIN_SEED_MAX)     # per-batch seeds are derived from it (64-bit room)
    check_device(args.device)
    check_out_dir(args.out)
    if args.prompts is not None:
        from .data.eval_sets import EVAL_SETS, OUTSIDE_SETS, load_eval_set

        # sets joined by + are each loaded (load_eval_set), so each part must pass the rule
        outside = [part for part in args.prompts.split("+") if part in OUTSIDE_SETS]
        if outside:
            which = "that set" if outside[0] == args.prompts else f"its part {outside[0]}"
            raise UserError(f"--prompts {args.prompts}: {which} is evaluation ground (prompts from outside the "
                            "project's corpora) and never training data; regenerate from the default corpora or a "
                            "JSONL file")
        domain = args.prompts if args.prompts in EVAL_SETS else "custom"
        prompts = [dict(p, domain=domain) for p in load_eval_set(args.prompts, cache_dir=args.cache_dir)]
    else:
        if args.n_math + args.n_code + args.n_prose == 0:
            raise UserError("nothing to do: --n-math, --n-code and --n-prose are all 0")
        prompts = training_prompts(args.n_math, args.n_code, cache_dir=args.cache_dir, n_prose=args.n_prose)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    regenerate(args.target, prompts, args.out, max_new_tokens=args.max_new_tokens,
               temperature=args.temperature, batch_size=args.batch_size, seed=args.seed,
               max_length=args.max_length, dtype=args.dtype, device=args.device, progress=not args.no_progress)
    meta = load_meta(args.out)
    print(json.dumps({k: meta[k] for k in ("rows", "counts", "truncated_without_eos", "mean_response_tokens",
                                           "generated_this_run", "seconds_this_run", "data_digest")}))
    return 0


if __name__ == "__main__":
    run_cli(main)
