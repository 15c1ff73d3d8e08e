"""What reading greedy tokens through the half-precision LM-head screen buys on this CPU, and that it changes nothing.

    python experiments/head_screen.py                 # -> experiments/results/head_screen.{md,json}
    python experiments/head_screen.py --quick --out /tmp/hs   (tests: 1 prompt, 12 tokens, untrained drafter)

Same process, embedded default target, greedy, batch 1 (docs/design.md#greedy-head-screen):

- **LM head alone**: the argmax of 1, 9 and 33 rows through the full float32 head and through the screen, each
  call after a 48 MB read (in decoding the forward's layers push the head out of the cache first); medians.
- **candidates**: the share of rows the screen decides without recomputing anything (one candidate), over the
  target's states at every prompt position of the sets.
- **decoding**: plain decoding, Domino chain and Domino tree (32 nodes) with the screen and with the full head,
  interleaved prompt by prompt (rotating order, `--repeats` times each, the fastest kept), ms per token; "speedup"
  is the median over prompts of each prompt's full-head time ÷ screened time. Every output is checked against the
  full head's plain decoding.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from domino_lab.config import repo_root
from domino_lab.errors import CliParser, UserError, check_out_dir, run_cli
from domino_lab.experiments.results import write_results
from domino_lab.target import cpu_line

CONFIGS = [("ar", None, 0), ("domino", "default", 0), ("domino-tree", "default", 32)]


def head_ms(target, rows: list[int], reps: int) -> dict:
    """Median ms of the argmax of `rows` hidden rows: full float32 head vs the screen, each after a 48 MB read."""
    w, screen = target.lm_head.weight, target.screen
    junk = torch.zeros(12_000_000)
    out = {}
    g = torch.Generator().manual_seed(0)
    for r in rows:
        h = torch.randn(r, w.shape[1], generator=g) * 4
        screen.argmax(h)                                   # builds the half-precision copy
        full, scr = [], []
        for _ in range(reps):
            for fn, acc in ((lambda: F.linear(h, w).argmax(-1), full), (lambda: screen.argmax(h), scr)):
                junk.add_(1.0)
                t0 = time.perf_counter()
                fn()
                acc.append(time.perf_counter() - t0)
        out[r] = {"full": 1000 * statistics.median(full), "screen": 1000 * statistics.median(scr)}
    return out


def candidate_share(target, prompts: list[list[int]]) -> dict:
    """Share of prompt positions the screen decides with one candidate, per half-precision copy."""
    with torch.no_grad():
        h = torch.cat([target.decoder(input_ids=torch.tensor([p])).last_hidden_state[0]
                       for p in prompts])
    screen, out = target.screen, {}
    for rows in (1, 9):                                    # one row: the float16 copy; several: the bfloat16 one
        half = screen.half_for(rows)
        hh = h.to(half.dtype)
        approx = F.linear(hh, half.w).float()
        floor = approx.amax(-1, keepdim=True) - 2 * screen.bound(h, hh, approx, half)
        n = (approx >= floor).sum(-1).float()
        out[str(half.dtype).removeprefix("torch.")] = {"one": float((n == 1).float().mean()), "mean": float(n.mean()),
                                                        "rows": len(h)}
    return out


def decode(args, prompts: list[list[int]]) -> dict:
    from domino_lab import Target, speculative_generate
    from domino_lab.models import load_drafter

    targets = {"screen": Target.from_pretrained("default", head_screen=True),
               "full": Target.from_pretrained("default", head_screen=False)}
    spec = "untrained:domino" if args.quick else "default"
    drafters = {k: load_drafter(spec, t) for k, t in targets.items()}
    runs = [(f"{name}/{head}", targets[head], drafters[head] if d else None, nodes)
            for name, d, nodes in CONFIGS for head in ("full", "screen")]
    per = {label: [] for label, *_ in runs}
    lossless = {label: 0 for label, *_ in runs}
    for i, ids in enumerate(prompts):
        ref = speculative_generate(targets["full"], None, prompt_ids=ids, max_new_tokens=args.max_new_tokens).token_ids
        best = {label: float("inf") for label, *_ in runs}
        for rep in range(args.repeats):
            k = (i * args.repeats + rep) % len(runs)
            for label, t, d, nodes in runs[k:] + runs[:k]:
                res = speculative_generate(t, d, prompt_ids=ids, max_new_tokens=args.max_new_tokens, tree_nodes=nodes)
                best[label] = min(best[label], 1000 * res.wall_time_s / len(res.token_ids))
                if rep == 0:
                    lossless[label] += res.token_ids == ref
        for label in per:
            per[label].append(best[label])
    out = {}
    for name, _, _ in CONFIGS:
        f, s = per[f"{name}/full"], per[f"{name}/screen"]
        out[name] = {"full_ms": statistics.median(f), "screen_ms": statistics.median(s),
                     "speedup": statistics.median(a / b for a, b in zip(f, s)),
                     "faster": sum(a > b for a, b in zip(f, s)), "prompts": len(f),
                     "lossless": {"full": lossless[f"{name}/full"], "screen": lossless[f"{name}/screen"]}}
    return out


def measure(args) -> dict:
    from domino_lab import Target
    from domino_lab.data.eval_sets import load_eval_set

    torch.set_num_threads(args.threads)
    target = Target.from_pretrained("default")
    by_set = {s: [target.encode(p["prompt"]) for p in load_eval_set(s, limit=args.limit)] for s in args.sets}
    res = {"head_ms": head_ms(target, [1, 9, 33], args.head_reps),
           "candidates": candidate_share(target, [p for ps in by_set.values() for p in ps]),
           "decoding": {s: decode(args, ps) for s, ps in by_set.items()}}
    return res


def report(res: dict, args) -> str:
    lines = ["# LM-head screen: greedy tokens from a half-precision head, on this CPU", "",
             f"`python experiments/head_screen.py {' '.join(res['argv'])}`".replace(" `", "`"), "",
             f"{res['machine']}, {args.threads} torch thread(s), torch {torch.__version__}; {res['date']}", "",
             "## LM head alone (argmax of the rows, after a 48 MB read)", "",
             "| rows | full float32 head | screen | ratio |", "|---|---|---|---|"]
    for r, v in res["head_ms"].items():
        lines.append(f"| {r} | {v['full']:.3f} ms | {v['screen']:.3f} ms | {v['full'] / v['screen']:.2f}× |")
    lines += ["", "## Rows decided without recomputing (one candidate)", "",
              "| copy | prompt positions | one candidate | candidates per row |", "|---|---|---|---|"]
    for k, v in res["candidates"].items():
        lines.append(f"| {k} | {v['rows']} | {100 * v['one']:.1f}% | {v['mean']:.2f} |")
    lines += ["", "## Decoding (ms per token, median over prompts; speedup = median of per-prompt full ÷ screen)", "",
              "| set | decoder | full head | screen | speedup | prompts faster | equal to the full head's greedy |",
              "|---|---|---|---|---|---|---|"]
    for s, rows in res["decoding"].items():
        for name, v in rows.items():
            lines.append(f"| {s} | {name} | {v['full_ms']:.2f} | {v['screen_ms']:.2f} | {v['speedup']:.3f}× | "
                         f"{v['faster']}/{v['prompts']} | {v['lossless']['screen']}/{v['prompts']} (full head "
                         f"{v['lossless']['full']}/{v['prompts']}) |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = CliParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", nargs="+", default=["math", "humaneval", "code", "unseen"])
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: what decoding the embedded default uses)")
    p.add_argument("--repeats", type=int, default=2, help="decodes of each prompt per configuration (fastest kept)")
    p.add_argument("--head-reps", type=int, default=60, help="timed LM-head calls per row count and path")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None, help="folder for head_screen.{md,json} (default experiments/results)")
    args = p.parse_args(argv)
    if args.quick:
        args.limit, args.max_new_tokens, args.sets, args.repeats, args.head_reps = 1, 12, args.sets[:1], 1, 3
    if min(args.limit, args.threads, args.repeats, args.head_reps) < 1 or args.max_new_tokens < 2:
        raise UserError("--limit, --threads, --repeats and --head-reps must be >= 1 and --max-new-tokens >= 2")
    out = check_out_dir(args.out if args.out is not None else repo_root() / "experiments" / "results")
    res = {"argv": list(argv if argv is not None else sys.argv[1:]), "date": time.strftime("%Y-%m-%d %H:%M UTC"),
           "machine": f"{cpu_line()}, {os.cpu_count()} CPUs", **measure(args)}
    write_results(out, "head_screen", res, report(res, args))
    return 0


if __name__ == "__main__":
    run_cli(main)
