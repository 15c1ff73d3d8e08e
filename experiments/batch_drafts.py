"""Batched decoding with a fixed number of drafts per step, against the adaptive count and plain batched decoding:
at which batch sizes, and with how many drafts, does speculative decoding pay on this machine, and why not where it
does not?

    python experiments/batch_drafts.py --sets math humaneval code unseen --limit 16 --batch-sizes 4 16 \
        --counts 0 1 2 4 8 --rounds 2 --out experiments/results/batch_drafts

For every set and batch size the prompts are decoded in consecutive batches by plain batched decoding (`ar`), by the
drafter verifying a fixed count n of drafts every step (n = 0: plain steps through the drafter's path, so the cost of
its taps alone) and by the adaptive count (decoding/adaptive.py), every configuration on a batch before the next
batch, the order rotating per batch and per round. Tokens/s is pooled per round; a configuration's speedup is the
median of its per-round ratios to `ar`. τ = tokens committed per row per verify step.

Why a count wins or loses, from the same decodes: the speedup is the plain decode's forward count over this one's
(`step gain`) divided by this decode's cost per forward over a plain one's (`step cost`: draft + verify ms per step
over `ar`'s ms per step). A batch runs until its slowest row is done, so its step gain is not the rows' mean τ: rows
that accepted more finish early and leave the later steps to fewer rows.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from domino_lab.cli_flags import add_threads_arg
from domino_lab.errors import CliParser, UserError, atomic_path, check_out_dir, run_cli


def parse_args(argv=None) -> argparse.Namespace:
    p = CliParser(prog="python experiments/batch_drafts.py", description=__doc__.splitlines()[0])
    p.add_argument("--target", default="default")
    p.add_argument("--drafter", default="default", help="drafter spec (load_drafter), e.g. default, default-dflash")
    p.add_argument("--sets", nargs="+", default=["math", "humaneval"])
    p.add_argument("--limit", type=int, default=16, help="prompts per set")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[4, 16])
    p.add_argument("--counts", type=int, nargs="+", default=[0, 1, 2, 4, 8], help="fixed draft counts to measure")
    p.add_argument("--continuous", action="store_true",
                   help="each batch size is the slots through which the set decodes as one queue (a finished row's "
                        "slot takes the next prompt) instead of consecutive batches of that size")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    add_threads_arg(p)
    p.add_argument("--out", default=None, help="folder for batch_drafts.{md,json,png} (default: print only)")
    a = p.parse_args(argv)
    if min(a.limit, a.max_new_tokens, a.rounds, *a.batch_sizes) < 1:
        raise UserError("--limit, --max-new-tokens, --rounds and --batch-sizes must be >= 1")
    if min(a.counts) < 0 or len(set(a.counts)) != len(a.counts):
        raise UserError(f"--counts must be distinct whole numbers >= 0, got {a.counts}")
    if a.drafter == "none":             # plain decoding is already the `ar` row every count is compared with
        raise UserError("--drafter none: this script measures a drafter's draft counts against plain decoding; "
                        "name a drafter, e.g. default or default-dflash")
    if a.out is not None:
        check_out_dir(a.out)
    return a


def measure(target, drafter, ids: list[list[int]], size: int, configs: list, max_new: int, rounds: int,
            continuous: bool = False) -> dict:
    """Every configuration ("ar", a draft count, "adaptive") over `ids` in batches of `size` (continuous: one queue
    through `size` slots): {label: its row}."""
    from domino_lab.bench import interleaved_batches
    from domino_lab.decoding.batched import batched_generate

    step = len(ids) if continuous else size
    chunks = [ids[i:i + step] for i in range(0, len(ids), step)]
    label = {c: c if isinstance(c, str) else f"n={c}" for c in configs}

    def run(c, k):
        return batched_generate(target, None if c == "ar" else drafter, chunks[k], max_new,
                                drafts=None if c == "ar" else c, slots=size)

    per_round, first = interleaved_batches(configs, len(chunks), rounds, run)
    totals, texts = {}, {}
    for c, results in first.items():          # greedy: every round decodes the same tokens
        totals[c] = {"committed": sum(sum(map(sum, r.acceptance_lengths)) for r in results),  # prefill token excluded
                     "row_steps": sum(sum(map(len, r.acceptance_lengths)) for r in results),
                     "steps": sum(r.steps for r in results), "draft_s": sum(r.draft_time_s for r in results),
                     "verify_s": sum(r.verify_time_s for r in results)}
        texts[c] = [t for r in results for t in r.token_ids]
    ar = totals["ar"]
    plain_ms = 1e3 * (ar["draft_s"] + ar["verify_s"]) / ar["steps"]
    out = {}
    for c in configs:
        t = totals[c]
        step_ms = 1e3 * (t["draft_s"] + t["verify_s"]) / t["steps"]
        out[label[c]] = {
            "tokens_per_s": statistics.median(per_round[c]), "tokens_per_s_rounds": per_round[c],
            "speedup_vs_ar": statistics.median(x / a for x, a in zip(per_round[c], per_round["ar"])),
            "tau": t["committed"] / t["row_steps"], "steps": t["steps"],
            "draft_ms": 1e3 * t["draft_s"] / t["steps"], "verify_ms": 1e3 * t["verify_s"] / t["steps"],
            "step_gain": ar["steps"] / t["steps"], "step_cost": step_ms / plain_ms,
            "equal_to_ar": sum(x == y for x, y in zip(texts[c], texts["ar"])), "prompts": len(ids)}
    return out


def markdown(results: dict, meta: dict) -> str:
    lines = [f"`{meta['command']}`", "",
             f"{meta['machine']}; {meta['date']}; {meta['wall_s']} s; drafter `{meta['drafter']}`; "
             f"{meta['max_new_tokens']} new tokens; "
             + ("each set one queue through `batch` slots; " if meta.get("continuous") else "")
             + f"tokens/s = median of {meta['rounds']} rounds, configurations interleaved per batch", "",
             "| set | batch | threads | config | τ (rows' mean) | tokens/s | × ar | draft ms/step | verify ms/step "
             "| step gain | step cost | equal to ar |", "|" + "---|" * 12]
    for s, by_size in results.items():
        for size, row in by_size.items():
            for lab, r in row["configs"].items():
                lines.append(f"| {s} | {size} | {row['threads']} | {lab} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} "
                             f"| {r['speedup_vs_ar']:.2f}× | {r['draft_ms']:.2f} | {r['verify_ms']:.2f} | "
                             f"{r['step_gain']:.2f} | {r['step_cost']:.2f} | {r['equal_to_ar']}/{r['prompts']} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, counts: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 3.4), sharey=True, squeeze=False)
    for ax, (s, by_size) in zip(axes[0], results.items()):
        for size, row in by_size.items():
            cfg = row["configs"]
            line, = ax.plot(counts, [cfg[f"n={c}"]["speedup_vs_ar"] for c in counts], marker="o", label=f"batch {size}")
            ax.axhline(cfg["adaptive"]["speedup_vs_ar"], color=line.get_color(), ls=":", lw=1)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(s)
        ax.set_xlabel("drafts verified per step")
    axes[0][0].set_ylabel("tokens/s ÷ plain batched (dotted: adaptive)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    from domino_lab.data.eval_sets import load_eval_set

    sets = {s: load_eval_set(s, limit=args.limit) for s in args.sets}      # bad names fail before any model loads
    from domino_lab.decoding.batched import batched_generate
    from domino_lab.models import load_drafter
    from domino_lab.target import Target, decode_threads, machine_line, openmp_waits, torch_threads

    target = Target.from_pretrained(args.target)
    drafter = load_drafter(args.drafter, target)
    if max(args.counts) > drafter.config.num_drafts:
        raise UserError(f"--counts go up to the drafter's {drafter.config.num_drafts} drafts, got {max(args.counts)}")
    configs = ["ar", *args.counts, "adaptive"]
    started = time.time()
    results: dict = {}
    for s, prompts in sets.items():
        ids = [target.encode(p["prompt"]) for p in prompts]
        results[s] = {}
        for size in args.batch_sizes:
            with torch_threads(decode_threads(target, args.threads, rows=min(size, len(ids)))) as n:
                batched_generate(target, drafter, ids[:2], 4)                  # warm-up at this thread count
                results[s][size] = {"threads": n, "configs": measure(target, drafter, ids, size, configs,
                                                                     args.max_new_tokens, args.rounds,
                                                                     args.continuous)}
            print(f"{s} batch {size}: " + ", ".join(f"{k} {v['speedup_vs_ar']:.2f}×"
                                                     for k, v in results[s][size]["configs"].items()),
                  file=sys.stderr, flush=True)
    meta = {"command": "python experiments/batch_drafts.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": machine_line(f"OpenMP waits: {openmp_waits()}"), "date": time.strftime("%Y-%m-%d %H:%M"),
            "wall_s": round(time.time() - started, 1), "drafter": args.drafter, "rounds": args.rounds,
            "max_new_tokens": args.max_new_tokens, "limit": args.limit, "continuous": args.continuous}
    md = markdown(results, meta)
    print(md)
    if args.out:
        out = Path(args.out)
        with atomic_path(out / "batch_drafts.json") as t:
            t.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        plot(results, args.counts, out / "batch_drafts.png")
        with atomic_path(out / "batch_drafts.md") as t:
            t.write_text(md + "\n![speedup against the draft count](batch_drafts.png)\n")
        print(f"wrote {out / 'batch_drafts.md'}", file=sys.stderr)
    bad = [(s, size, lab) for s, by in results.items() for size, row in by.items()
           for lab, r in row["configs"].items() if r["equal_to_ar"] != r["prompts"]]
    if bad:
        print(f"error: outputs differ from plain decoding in {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    run_cli(main)
