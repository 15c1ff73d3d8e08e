"""Compare drafters on eval sets with the real engine: τ, per-position acceptance, paired per-prompt differences.

    python experiments/compare_drafters.py --drafter domino=default --drafter dflash=default-dflash \
        --sets math humaneval --max-new-tokens 128 --out experiments/results/drafters.json

`NAME=SPEC` where SPEC is a checkpoint dir, a shipped name, or `SPEC:head-off` (same model, Domino head off), and
`NAME=SPEC@key=value,...` runs it with those inference options, as the bench does (e.g. `default@candidate_pool=0`).
The first drafter is compared with each other one, prompt by prompt (τ_a − τ_b, 95% CI, wins/losses).

Where every drafter must reproduce plain decoding token for token (greedy; or the gumbel sampler with one sample per
prompt), each set is also decoded once without a drafter and every drafter's output is checked against it: the
"equal to plain" column, `lossless` in the JSON, and exit status 1 with one line per drafter that differs.
"""
from __future__ import annotations

import argparse
import sys

from domino_lab.data.eval_sets import load_eval_set
from domino_lab.cli_flags import add_sampler_arg
from domino_lab.errors import CliParser, check_out_file, run_cli
from domino_lab.evaluate import (differing_prompts, drafter_provenance, evaluate, must_equal_plain, named_drafters,
                                 paired, run_record, save_results)
from domino_lab.target import Target


def main(argv=None) -> int:
    p = CliParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="default")
    p.add_argument("--drafter", action="append", required=True, help="NAME=SPEC[@key=value,...] (repeat)")
    p.add_argument("--sets", nargs="+", default=["math", "humaneval"])
    p.add_argument("--limit", type=int)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--samples", type=int, default=1,
                   help="T > 0: sampling seeds per prompt, pooled into the prompt's τ (less noise per paired difference)")
    add_sampler_arg(p)
    p.add_argument("--out", required=True, help="JSON results (a markdown table is printed and written beside it)")
    args = p.parse_args(argv)
    check_out_file(args.out)
    target = Target.from_pretrained(args.target)
    drafters = named_drafters(args.drafter, target)
    results = {**run_record(), "drafters": drafter_provenance(args.drafter), "sets": {}}
    lines = ["| set | drafter | τ | paired Δτ vs first (95% CI) | wins/losses | accept per position | draft ms | "
             "equal to plain |", "|---|---|---|---|---|---|---|---|"]
    names = list(drafters)
    check = must_equal_plain(args.temperature, args.sampler, args.samples)
    lossy = []
    for s in args.sets:
        prompts = load_eval_set(s, limit=args.limit)
        kw = dict(temperature=args.temperature, samples=args.samples, sampler=args.sampler, keep_ids=check)
        plain = evaluate(target, None, prompts, args.max_new_tokens, **kw) if check else None
        res = {n: evaluate(target, d, prompts, args.max_new_tokens, progress=True, **kw) for n, d in drafters.items()}
        if check:
            for n, r in res.items():
                bad = differing_prompts(r, plain)
                r["lossless"] = {"equal": len(prompts) - len(bad), "total": len(prompts), "mismatch_prompts": bad}
                if bad:
                    lossy.append(f"{n} on {s}: {len(bad)} of {len(prompts)} outputs differ from plain decoding "
                                 f"(first: {bad[0]})")
        results["sets"][s] = {n: r for n, r in res.items()}
        for n in names:
            pr = paired(res[names[0]], res[n]) if n != names[0] else None
            pos = " ".join(f"{a:.2f}" for a in res[n]["accept_pos"] if a is not None)
            cmp = (f"{pr['mean_diff']:+.3f} ({pr['ci95'][0]:+.3f}, {pr['ci95'][1]:+.3f}); ratio {pr['ratio']:.3f}"
                   if pr else "–")
            wl = f"{pr['wins']}/{pr['losses']}" if pr else "–"
            ll = res[n].get("lossless")
            eq = f"{ll['equal']}/{ll['total']}" if ll else "–"
            lines.append(f"| {s} | {n} | {res[n]['tau']:.3f} | {cmp} | {wl} | {pos} | {res[n]['draft_ms']:.2f} | "
                         f"{eq} |")
            if pr:
                results["sets"][s][f"paired_{names[0]}_vs_{n}"] = pr
    save_results(args.out, results, lines)
    for line in lossy:
        print(f"error: not lossless: {line}", file=sys.stderr)
    return 1 if lossy else 0


if __name__ == "__main__":
    run_cli(main)
