"""`python -m domino_lab.inference`: the command line over `predict` (the package docstring has the usage).

The parser is built and read before torch or Lightning load, so `--help` and a bad flag answer at once."""
from __future__ import annotations

import json
from pathlib import Path

from ..cli_flags import add_sampler_arg, add_threads_arg, check_greedy_flags
from ..errors import CliParser, UserError, atomic_path, check_out_file, run_cli
from . import __doc__ as USAGE


def main(argv=None) -> int:
    p = CliParser(prog="python -m domino_lab.inference", description=USAGE.split("\n\n")[0])
    p.add_argument("--target", default="default")
    p.add_argument("--drafter", default="default", help="checkpoint dir, shipped name, or 'none'")
    p.add_argument("--prompts", required=True, help="eval set name (math, humaneval, code, unseen, fresh) or JSONL file")
    p.add_argument("--out", required=True, help="JSONL output (one row per prompt; rank files under DDP)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    add_sampler_arg(p)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--batched", action="store_true",
                   help="decode each batch's prompts together (batched decoding: the same tokens, throughput at "
                        "larger batches, no per-step records in the output)")
    p.add_argument("--slots", type=int, default=None, metavar="S",
                   help="with --batched: decode each batch as a queue through S rows at a time, a finished row's place "
                        "going to the batch's next prompt (continuous batching; default: the whole batch at once)")
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--devices", default="auto")
    p.add_argument("--strategy", default="auto")
    p.add_argument("--precision", default=None, help="e.g. bf16-mixed on GPU (default 32-true)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--limit", type=int, default=None)
    add_threads_arg(p)
    p.add_argument("--tree-nodes", type=int, default=0, metavar="N",
                   help="verify a draft tree of N nodes per step (block drafters, any temperature; 0 = chain)")
    from ..models.options import add_inference_args, check_tree_flags
    add_inference_args(p, block_size=True)
    args = p.parse_args(argv)
    from ..data.eval_sets import load_eval_set
    from ..models import InferenceOptions
    from .decoder import check_batching, make_trainer, parse_devices, predict

    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1")
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {args.batch_size}")
    from ..decoding.tree import check_tree_nodes

    check_tree_nodes(args.tree_nodes, "--tree-nodes")
    check_batching(args.batch_size, args.batched, args.slots)
    check_out_file(args.out)             # rank files go beside it, so this covers them too
    check_tree_flags(args, args.tree_nodes)
    from ..training.devices import check_not_spawned

    check_not_spawned(args.strategy)
    # everything a user can get wrong is checked before the trainer exists: making one prints Lightning's lines
    # about the hardware, which would stand above the one error line
    options = InferenceOptions.from_args(args)
    from ..sampling import check_sampling
    from ..target import Target, parse_dtype, use_decode_threads

    check_sampling(args.temperature, 1.0, args.sampler, bool(options.tree_sampled))
    check_greedy_flags(args)
    parse_dtype(args.dtype)
    rows = load_eval_set(args.prompts, limit=args.limit)
    trainer = make_trainer(args.accelerator, parse_devices(args.devices), args.strategy, args.precision)

    target = Target.from_pretrained(args.target, dtype=args.dtype)
    use_decode_threads(target, args.threads,
                       rows=min(args.slots or args.batch_size, args.batch_size) if args.batched else 1)
    out = predict(target, args.drafter, rows, max_new_tokens=args.max_new_tokens,
                  temperature=args.temperature, batch_size=args.batch_size, dtype=args.dtype,
                  options=options, tree_nodes=args.tree_nodes, sampler=args.sampler,
                  batched=args.batched, slots=args.slots, steps=not args.batched, trainer=trainer)
    path = Path(args.out)
    rank = out[0]["rank"] if out else 0
    if rank:
        path = path.with_name(f"{path.stem}.rank{rank}{path.suffix}")
    with atomic_path(path) as t:
        t.write_text("".join(json.dumps(r) + "\n" for r in out))
    lengths = [a for r in out for a in r["acceptance_lengths"]]     # τ pooled over steps, as decoding.metrics
    print(json.dumps({"out": str(path), "prompts": len(out),
                      "tau": sum(lengths) / len(lengths) if lengths else None}))
    return 0


if __name__ == "__main__":
    run_cli(main)
