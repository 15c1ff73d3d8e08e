"""Chain vs tree verification: τ and tokens/s against the node budget N for the block drafters.

    python experiments/tree.py                      # the shipped drafters, N = 8 16 32 64, writes experiments/results/tree.*
    python experiments/tree.py --quick --out /tmp/tree      # 2 prompts, 16 tokens, 1 round (a smoke test)
    python experiments/tree.py --drafter domino/s0=runs/a/best --drafter domino/s1=runs/b/best ...
    python experiments/tree.py --drafter domino=default --drafter domino-p03=default@tree_min_prob=0.03
    python experiments/tree.py --temperature 1 --rounds 4          # sampled decoding: τ over 4 samples per prompt
    python experiments/tree.py --temperature 1 --sampler gumbel    # Gumbel-coupled: every output checked against ar

Every configuration (plain decoding `ar`, each drafter as a chain, each drafter at each N) decodes the same prompts;
τ is deterministic under greedy decoding, wall-clock is not, so the whole grid is decoded in `--rounds` rounds,
interleaved prompt by prompt (every configuration decodes a prompt before any moves to the next, in an order that
rotates with the prompt and the round, after a warm-up): tokens/s is the median over rounds, with its min and max, and
each ratio to the same drafter's chain is the median of the per-round ratios, so a slow spell of the machine falls on
a tree and its chain alike.
Several trained seeds of one drafter are given as LABEL=SPEC pairs named `family/seed`: the summary then reports
mean ± sd over the seeds of each family. Every output is checked against `ar` token for token. With `--temperature`
T > 0 each round draws a new sample of every prompt (seeded by round and prompt, the same seeds for every
configuration); τ pools every round's steps, and exactness is the distribution tests' job (tests/test_sampling.py),
since samples cannot be compared token for token, except with `--sampler gumbel`, where a seed fixes the text and
every output is again checked against `ar`'s.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from domino_lab.cli_flags import add_sampler_arg, add_threads_arg  # noqa: E402
from domino_lab.errors import CliParser, UserError, atomic_path, check_out_dir, run_cli  # noqa: E402

DEFAULT_DRAFTERS = ["domino=default", "dflash=default-dflash"]


def parse_args(argv=None) -> argparse.Namespace:
    p = CliParser(prog="python experiments/tree.py", description=__doc__.splitlines()[0])
    p.add_argument("--target", default="default")
    p.add_argument("--dtype", default="float32", help="the target's dtype (drafters follow it): float32, bfloat16, ...")
    p.add_argument("--drafter", action="append", default=None, metavar="LABEL=SPEC[@key=value,...]",
                   help="a block drafter to compare (repeat; `family/seed` labels are pooled per family; after @, "
                        "inference options, e.g. domino-p03=default@tree_min_prob=0.03); default: "
                        + " ".join(DEFAULT_DRAFTERS))
    p.add_argument("--nodes", nargs="+", type=int, default=[8, 16, 32, 64], help="tree node budgets N")
    p.add_argument("--sets", nargs="+", default=["math", "humaneval", "code"])
    p.add_argument("--limit", type=int, default=12, help="prompts per set")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (tokens/s = their median)")
    p.add_argument("--warmup", type=int, default=1, help="prompts every configuration decodes before timing")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (0 = greedy, the default); > 0: every round is a new sample")
    add_sampler_arg(p)                 # (with gumbel every output is checked against ar's sample again)
    add_threads_arg(p)
    p.add_argument("--out", default=str(ROOT / "experiments" / "results"), help="folder for tree.{md,json,png}")
    p.add_argument("--quick", action="store_true", help="2 prompts per set, 16 new tokens, 1 round (smoke test)")
    p.add_argument("--compare", nargs=2, default=None, metavar=("A", "B"),
                   help="two drafter families whose per-prompt τ is compared pairwise at every N (default: the first "
                        "two families given)")
    args = p.parse_args(argv)
    check_out_dir(args.out)
    if args.quick:
        args.limit, args.max_new_tokens, args.rounds = min(args.limit, 2), min(args.max_new_tokens, 16), 1
    from domino_lab.decoding.tree import check_tree_nodes

    if any(check_tree_nodes(n, "--nodes") < 1 for n in args.nodes):
        raise UserError("--nodes are tree budgets >= 1 (the chain, N = 0, is always measured)")
    if min(args.limit, args.max_new_tokens, args.rounds) < 1 or args.warmup < 0:
        raise UserError("--limit, --max-new-tokens and --rounds must be >= 1, --warmup >= 0")
    if not 0.0 <= args.temperature <= 10.0:
        raise UserError(f"--temperature must be in [0, 10] (0 = greedy), got {args.temperature}")
    args.drafter = args.drafter or DEFAULT_DRAFTERS
    from domino_lab.models.options import drafter_items

    args.items = drafter_items(args.drafter, reserved=["ar"])      # bad items fail before any model loads
    families = list(dict.fromkeys(it.label.split("/")[0] for it in args.items))
    if args.compare is None:
        args.compare = families[:2] if len(families) >= 2 else None
    elif any(f not in families for f in args.compare) or args.compare[0] == args.compare[1]:
        raise UserError(f"--compare takes two different drafter families among {families}, got {args.compare}")
    return args


def run(args) -> dict:
    from domino_lab import Target, speculative_generate
    from domino_lab.data.eval_sets import load_eval_set
    from domino_lab.decoding.engine import check_tree_mode
    from domino_lab.decoding.metrics import StepTally
    from domino_lab.models.drafter import load_item
    from domino_lab.target import use_decode_threads

    sets = {s: load_eval_set(s, limit=args.limit) for s in args.sets}        # bad names fail before any model loads
    target = Target.from_pretrained(args.target, dtype=args.dtype)
    use_decode_threads(target, args.threads)
    drafters = {}
    for it in args.items:
        drafters[it.label] = load_item(it, target)
        check_tree_mode(drafters[it.label])         # an EAGLE chain (or anything else) fails here, early
    nodes = sorted(set(args.nodes))
    # configuration = (label, N); ("ar", 0) is plain decoding, N = 0 the chain
    configs = [("ar", 0)] + [(lab, n) for lab in drafters for n in [0] + nodes]

    def decode(cfg, ids, seed=0):
        lab, n = cfg
        return speculative_generate(target, drafters.get(lab), prompt_ids=ids, max_new_tokens=args.max_new_tokens,
                                    tree_nodes=n, temperature=args.temperature, seed=seed, sampler=args.sampler)

    # greedy, or Gumbel-coupled sampling: every configuration's output must equal plain decoding's
    comparable = not args.temperature or args.sampler == "gumbel"
    results: dict = {}
    for s, prompts in sets.items():
        ids = [target.encode(p["prompt"]) for p in prompts]
        for x in ids[: args.warmup]:
            for cfg in configs:
                decode(cfg, x)
        walls = {cfg: [0.0] * args.rounds for cfg in configs}
        made = {cfg: [0] * args.rounds for cfg in configs}          # tokens per round (samples differ in length)
        outs: dict = {cfg: [[] for _ in ids] for cfg in configs}    # every round's result, per prompt
        for r in range(args.rounds):
            for i, x in enumerate(ids):
                k = (r + i) % len(configs)             # rotate so no configuration always runs first
                for cfg in configs[k:] + configs[:k]:
                    res = decode(cfg, x, seed=1_000_003 * r + i)
                    walls[cfg][r] += res.wall_time_s
                    made[cfg][r] += len(res.token_ids)
                    outs[cfg][i].append(res)
        ref = [x[-1].token_ids for x in outs[("ar", 0)]]
        rows = {}
        for cfg in configs:
            every = outs[cfg]
            res = [x[-1] for x in every]                # the last round's decode of each prompt
            tokens = sum(len(x.token_ids) for x in res)
            tps = [m / w for m, w in zip(made[cfg], walls[cfg])]      # per round
            tally = StepTally().add(st for x in every for y in x for st in y.steps)
            rows[f"{cfg[0]}@{cfg[1]}"] = {
                "label": cfg[0], "nodes": cfg[1], "tau": tally.tau, "tokens": tokens,
                "tokens_per_s": statistics.median(tps), "tokens_per_s_min": min(tps), "tokens_per_s_max": max(tps),
                "draft_ms": tally.draft_ms, "verify_ms": tally.verify_ms,
                "tokens_per_s_rounds": tps,
                "lossless": (sum(x.token_ids == a for x, a in zip(res, ref)) if comparable else None),
                "prompts": len(res),
                "per_prompt_tau": [pooled_tau(x) for x in every],
                "per_prompt": [{"id": p.get("id", str(i)), "tau": pooled_tau(x), "steps": sum(len(y.steps) for y in x)}
                               for i, (p, x) in enumerate(zip(prompts, every))]}
        for key, row in rows.items():               # ratios against the same drafter's chain and against ar
            chain = rows.get(f"{row['label']}@0")
            if row["label"] != "ar":
                row["tau_vs_chain"] = row["tau"] / chain["tau"] if chain["tau"] else None
                row["speed_vs_chain"] = paired_ratio(row, chain)
            row["speed_vs_ar"] = paired_ratio(row, rows["ar@0"])
        results[s] = rows
    return results


def pooled_tau(results) -> float:
    """τ of one prompt over its decodes (every round's sample at T > 0; the rounds agree under greedy decoding)."""
    steps = sum(len(x.steps) for x in results)
    return sum(len(x.token_ids) - 1 for x in results) / steps if steps else 0.0


def paired_ratio(row: dict, ref: dict) -> float:
    """Tokens/s of `row` over `ref`'s: the median over rounds of each round's ratio (both decoded the same prompts
    in that round, interleaved prompt by prompt)."""
    return statistics.median(a / b for a, b in zip(row["tokens_per_s_rounds"], ref["tokens_per_s_rounds"]))


def summary(results: dict) -> dict:
    """Per set, family (the label before '/') and N: mean ± sd over the family's seeds of τ, tokens/s and the ratios."""
    out: dict = {}
    for s, rows in results.items():
        groups: dict = {}
        for row in rows.values():
            if row["label"] == "ar":
                continue
            groups.setdefault((row["label"].split("/")[0], row["nodes"]), []).append(row)
        for (fam, n), rs in sorted(groups.items()):
            def ms(k):
                xs = [r[k] for r in rs if r.get(k) is not None]
                return (statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0) if xs else (None, None)
            out.setdefault(s, {})[f"{fam}@{n}"] = {"family": fam, "nodes": n, "seeds": len(rs),
                                                  **{k: ms(k) for k in ("tau", "tokens_per_s", "tau_vs_chain",
                                                                        "speed_vs_chain", "speed_vs_ar")},
                                                  "lossless": (None if rs[0]["lossless"] is None else
                                                               sum(r["lossless"] for r in rs)),
                                                  "prompts": sum(r["prompts"] for r in rs)}
    return out


def compare(results: dict, a: str, b: str) -> dict:
    """Per set and N: per-prompt τ of family a minus family b (seeds pooled: seed k of a pairs with seed k of b when
    both are labelled `family/k`, otherwise every seed of one with every seed of the other), mean, 95% CI, wins."""
    from domino_lab.experiments.report import pooled_pair

    out: dict = {}
    for s, rows in results.items():
        by_n: dict = {}                  # N -> family -> seed -> row, the shape pooled_pair reads
        for row in rows.values():
            fam, _, seed = row["label"].partition("/")
            by_n.setdefault(row["nodes"], {}).setdefault(fam, {})[seed] = row
        for n, cell in sorted(by_n.items()):
            pr = pooled_pair(cell, a, b)
            if pr is not None:
                out.setdefault(s, {})[n] = pr
    return out


def compare_table(cmp: dict, a: str, b: str) -> str:
    lines = [f"Per-prompt τ({a}) − τ({b}), paired, at each N (chain = N 0); the 95% CI is over the prompts (each "
             "prompt's mean over the seed pairs), wins / losses / ties count every difference:", "",
             "| set | N | prompts | differences | mean Δτ | 95% CI | wins / losses / ties |", "|" + "---|" * 7]
    for s, per_n in cmp.items():
        for n, pr in per_n.items():
            if not pr.get("n"):
                continue
            lo, hi = pr["ci95"]
            lines.append(f"| {s} | {'chain' if n == 0 else n} | {pr['prompts']} | {pr['n']} | {pr['mean_diff']:+.2f} | "
                         f"[{lo:+.2f}, {hi:+.2f}] | {pr['wins']} / {pr['losses']} / {pr['ties']} |")
    return "\n".join(lines)


def _pm(v, f="{:.2f}"):
    m, sd = v
    if m is None:
        return "–"
    return f.format(m) + (f" ± {f.format(sd)}" if sd else "")


def table(summ: dict) -> str:
    lines = ["| set | drafter | N | seeds | τ | τ vs chain | tokens/s | tokens/s vs chain | vs ar | equal to ar |",
             "|" + "---|" * 10]
    for s, rows in summ.items():
        for r in rows.values():
            lines.append(f"| {s} | {r['family']} | {'chain' if r['nodes'] == 0 else r['nodes']} | {r['seeds']} | "
                         f"{_pm(r['tau'])} | {_pm(r['tau_vs_chain'])} | {_pm(r['tokens_per_s'], '{:.1f}')} | "
                         f"{_pm(r['speed_vs_chain'])} | {_pm(r['speed_vs_ar'])} | "
                         + ("sampled |" if r["lossless"] is None else f"{r['lossless']}/{r['prompts']} |"))
    return "\n".join(lines)


def plot(summ: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(summ), figsize=(4.5 * len(summ), 6.4), squeeze=False)
    for j, (s, rows) in enumerate(summ.items()):
        fams = sorted({r["family"] for r in rows.values()})
        for fam in fams:
            rs = sorted((r for r in rows.values() if r["family"] == fam), key=lambda r: r["nodes"])
            xs = [max(r["nodes"], 1) for r in rs]              # the chain (N = 0) sits at x = 1 on the log axis
            for ax, k in ((axes[0][j], "tau"), (axes[1][j], "tokens_per_s")):
                ax.errorbar(xs, [r[k][0] for r in rs], yerr=[r[k][1] for r in rs], marker="o", capsize=3,
                            label=fam)
        for ax, name in ((axes[0][j], "τ"), (axes[1][j], "tokens/s")):
            ax.set_xscale("log", base=2)
            ticks = sorted({max(r["nodes"], 1) for r in rows.values()})
            ax.set_xticks(ticks, ["chain" if t == 1 else str(t) for t in ticks])
            ax.set_title(f"{s}: {name} vs tree nodes N")
            ax.set_xlabel("N (chain = the block's chain)")
            ax.legend()
    fig.tight_layout()
    with atomic_path(path, suffix=path.suffix) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    from domino_lab.target import machine_line

    started = time.time()
    results = run(args)
    summ = summary(results)
    meta = {"command": "python experiments/tree.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": machine_line(), "date": time.strftime("%Y-%m-%d %H:%M"),
            "target": args.target, "dtype": args.dtype, "drafters": args.drafter, "nodes": sorted(set(args.nodes)),
            "limit": args.limit, "max_new_tokens": args.max_new_tokens, "rounds": args.rounds,
            "temperature": args.temperature, "sampler": args.sampler, "wall_s": round(time.time() - started, 1)}
    out = Path(args.out)
    cmp = compare(results, *args.compare) if args.compare else {}
    with atomic_path(out / "tree.json") as t:
        t.write_text(json.dumps({"meta": meta, "summary": summ, "results": results,
                                 "compare": {"families": args.compare, "by_set": cmp}}, indent=1))
    plot(summ, out / "tree.png")
    bad = [f"{s}/{k}" for s, rows in results.items() for k, r in rows.items()
           if r["lossless"] not in (None, r["prompts"])]
    md = table(summ)
    sampled = (f"T = {args.temperature:g}: each round is a new sample of every prompt, τ pools all {args.rounds} "
               "rounds' steps, and exactness is shown by the distribution tests, not by comparing samples")
    if args.temperature and args.sampler == "gumbel":
        sampled = (f"T = {args.temperature:g}, gumbel sampler: each round is a new sample of every prompt, the same "
                   f"text for every configuration (checked), τ pools all {args.rounds} rounds' steps")
    check = (f"**Output differs from `ar` for {bad}.**" if bad else sampled if args.temperature else
             "Every configuration's output equals plain greedy decoding on every prompt")
    text = (f"# Chain vs tree verification\n\n`{meta['command']}`\n\n{meta['machine']}; {meta['date']}; "
            f"{meta['wall_s']} s; {args.limit} prompts per set, {args.max_new_tokens} new tokens, tokens/s = median "
            f"of {args.rounds} rounds interleaved prompt by prompt; the ratios ('vs chain', 'vs ar') = median of "
            f"the per-round ratios\n\n{md}\n\n"
            + (compare_table(cmp, *args.compare) + "\n\n" if cmp else "")
            + check + ".\n\n"
            + "![τ and tokens/s against N](tree.png)\n")
    with atomic_path(out / "tree.md") as t:
        t.write_text(text)
    print(md)
    print(f"wrote {out / 'tree.md'}, {out / 'tree.json'} and {out / 'tree.png'}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    run_cli(main)
