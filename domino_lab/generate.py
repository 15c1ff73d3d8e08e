"""`python -m domino_lab.generate`: speculative (or plain) decoding from the command line.

Prints the text, or with --json one JSON object per prompt (docs/design.md#contracts).
"""
from __future__ import annotations

import argparse
import json
import sys

from .cli_flags import add_sampler_arg, add_threads_arg, check_greedy_flags
from .errors import CliParser, UserError, run_cli


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(prog="python -m domino_lab.generate", description=__doc__)
    p.add_argument("--target", default="default", help="HF model id, local model dir, or 'default' (embedded)")
    p.add_argument("--drafter", default="default",
                   help="checkpoint dir, shipped name (default, default-dflash), 'none' (plain decoding), "
                        "or untrained:METHOD[:key=value,...] (e.g. untrained:domino, untrained:eagle, "
                        "untrained:dflash:block_size=16)")
    p.add_argument("--dtype", default="float32",
                   help="float32 (CPU default), bfloat16, float64 (bfloat16 rounds a block verify and a one-token "
                        "step differently: at a near-tie the text can differ from plain bfloat16 decoding)")
    p.add_argument("--device", default="cpu")
    add_threads_arg(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompts", help="an eval set (math, humaneval, code, unseen, fresh) or a JSONL file of "
                                       "{\"id\", \"prompt\"} lines; each prompt's text in turn (with --json, one "
                                       "JSON object per line)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    add_sampler_arg(p)
    from .models.options import add_inference_args
    add_inference_args(p, block_size=True)
    p.add_argument("--tree-nodes", type=int, default=0, metavar="N",
                   help="verify a draft tree of N nodes per step instead of the chain (block drafters, any "
                        "temperature; 0 = chain, the default)")
    p.add_argument("--steps", action="store_true", help="include per-step records in the JSON")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from . import Target, speculative_generate
    from .decoding.engine import (RECORD_TOPK, check_lookup_mode, check_tree_mode, prompt_token_ids,
                                  prompts_token_ids)
    from .sampling import check_sampling
    from .decoding.tree import check_tree_nodes
    from .models import InferenceOptions, load_drafter
    from .models.options import check_tree_flags
    from .target import use_decode_threads
    from .validation import check_device, check_number, check_seed

    # every flag, then every prompt, is checked before anything is decoded or printed
    check_seed(args.seed, "--seed")
    check_device(args.device)
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    check_number(args.temperature, "--temperature", low=0)
    check_number(args.top_p, "--top-p", low=0, high=1, low_open=True)
    check_greedy_flags(args)
    check_tree_nodes(args.tree_nodes, "--tree-nodes")
    if args.steps and not args.json:
        raise UserError("--steps adds the per-step records to the JSON output: add --json")
    check_tree_flags(args, args.tree_nodes)
    torch.manual_seed(args.seed)
    from .data.eval_sets import check_prompt_text, load_eval_set

    prompts = load_eval_set(args.prompts) if args.prompts is not None else [{"id": None, "prompt": args.prompt}]
    if any(not r["prompt"].strip() for r in prompts):
        raise UserError("the prompt is empty; give some text to continue")
    if args.prompt is not None:     # (a file's prompts were checked as it was read)
        check_prompt_text(args.prompt, "--prompt", "pass it as UTF-8 text (the shell handed over bytes that are "
                                                   "not UTF-8: check the terminal's or the file's encoding)")
    options = InferenceOptions.from_args(args)
    target = Target.from_pretrained(args.target, dtype=args.dtype, device=args.device)
    use_decode_threads(target, args.threads)
    ids = ([prompt_token_ids(target, args.prompt)] if args.prompt is not None else
           prompts_token_ids(target, prompts, args.prompts))
    drafter = load_drafter(args.drafter, target, seed=args.seed, options=options)
    check_lookup_mode(drafter, options.lookup)
    if args.tree_nodes:
        check_tree_mode(drafter)
    check_sampling(args.temperature, args.top_p, args.sampler, options.tree_sampled)
    for row, prompt_ids in zip(prompts, ids):
        res = speculative_generate(target, drafter, prompt_ids=prompt_ids, max_new_tokens=args.max_new_tokens,
                                   temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                                   tree_nodes=args.tree_nodes, topk=RECORD_TOPK if args.steps else 0,
                                   sampler=args.sampler)
        if args.json:
            d = res.to_dict(steps=args.steps)
            if row["id"] is not None:
                d = {"id": row["id"]} | d
            print(json.dumps(d), flush=True)
        else:
            print(res.text, flush=True)
            print(f"[tau={res.mean_acceptance_length:.2f} tokens={len(res.token_ids)} "
                  f"target_calls={res.target_forward_calls} {res.tokens_per_s:.1f} tok/s]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_cli(main)
