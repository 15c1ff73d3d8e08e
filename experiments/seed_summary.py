"""Aggregate `compare_drafters.py` results over seeds: per-seed τ ratios and pooled per-prompt paired differences.

    python experiments/seed_summary.py --runs experiments/results/drafters_seed0.json experiments/results/drafters_seed1.json \
        --pair domino dflash --pair domino domino_no_curriculum --out experiments/results/drafters_seeds.md

At laptop scale the seed-to-seed spread is as large as the effect (docs/design.md#laptop-scale-evidence): a claim
rests on every seed agreeing and on the paired differences, not on one run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from domino_lab.errors import CliParser, UserError, atomic_path, check_out_file, run_cli
from domino_lab.evaluate import paired_pooled


def summarize(runs: list[dict], a: str, b: str) -> dict:
    """Per eval set that every run has both drafters on (a pair measured on some sets only is summarised there)."""
    out = {}
    sets = [s for s in runs[0]["sets"] if all(a in r["sets"].get(s, {}) and b in r["sets"].get(s, {}) for r in runs)]
    if not sets:
        names = sorted({n for r in runs for res in r["sets"].values() for n in res})
        raise UserError(f"no eval set has drafters {a!r} and {b!r} in every run; names: {names}")
    for s in sets:
        ratios = [r["sets"][s][a]["tau"] / r["sets"][s][b]["tau"] for r in runs]
        # one difference per (seed, prompt); the interval is over the prompts (evaluate.paired_pooled)
        pr = paired_pooled([(r["sets"][s][a], r["sets"][s][b]) for r in runs])
        out[s] = {"ratios": ratios, "ratio_mean": statistics.fmean(ratios),
                  "ratio_sd": statistics.stdev(ratios) if len(ratios) > 1 else 0.0,
                  "pooled_diff": pr["mean_diff"], "pooled_ci95": pr["ci95"], "n": pr["n"], "prompts": pr["prompts"],
                  "wins": pr["wins"], "losses": pr["losses"]}
    return out


def data_mismatches(runs: list[dict], a: str, b: str) -> list[str]:
    """Seeds in which `a` and `b` record different training data (content digests in the result files; drafters
    saved before digests were recorded say nothing and are not flagged). A paired difference then measures the
    data as well as the method, which may be intended (a data experiment) but should never go unnoticed."""
    out = []
    for k, r in enumerate(runs):
        da, db = (r.get("drafters", {}).get(n, {}).get("data_digest") for n in (a, b))
        if da and db and da != db:
            out.append(f"seed run {k}: {a} was trained on data {da}, {b} on {db}")
    return out


def load_seed(spec: str, rename: dict[str, str] | None = None) -> dict:
    """One seed's results: a compare_drafters.py JSON, or several joined with '+' (their drafters merged per set).
    `rename` {old: new} gives drafters of different runs one name (e.g. one recipe labelled per seed)."""
    rename = rename or {}
    merged: dict = {"sets": {}, "drafters": {}}
    for f in spec.split("+"):
        try:
            run = json.loads(Path(f).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"cannot read {f}: {e}") from None
        merged["drafters"].update({rename.get(n, n): v for n, v in run.get("drafters", {}).items()})
        for s, res in run["sets"].items():
            merged["sets"].setdefault(s, {}).update({rename.get(n, n): v for n, v in res.items()})
    return merged


def parse_renames(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        old, sep, new = item.partition("=")
        if not sep or not old or not new:
            raise UserError(f"--rename {item!r} must be OLD=NEW")
        out[old] = new
    return out


def main(argv=None) -> int:
    p = CliParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", required=True,
                   help="compare_drafters.py JSON files, one per seed; A.json+B.json joins two runs of one seed "
                        "(drafters measured in separate invocations)")
    p.add_argument("--pair", nargs=2, action="append", required=True, metavar=("A", "B"))
    p.add_argument("--rename", action="append", default=[], metavar="OLD=NEW",
                   help="read drafter OLD as NEW in every run (repeat), so that one recipe labelled differently in "
                        "each seed's file pools under one name")
    p.add_argument("--out", required=True, help="markdown output (JSON beside it)")
    args = p.parse_args(argv)
    check_out_file(args.out)
    renames = parse_renames(args.rename)
    runs = [load_seed(spec, renames) for spec in args.runs]
    result = {f"{a}_vs_{b}": summarize(runs, a, b) for a, b in args.pair}
    lines = [f"Seeds: {len(runs)} ({', '.join(args.runs)})", "",
             "| pair | set | τ ratio per seed | mean ± sd | pooled per-prompt Δτ (95% CI) | wins/losses |",
             "|---|---|---|---|---|---|"]
    for a, b in args.pair:
        for line in data_mismatches(runs, a, b):
            print(f"warning: {line}", file=sys.stderr)
            lines.insert(1, f"Note: {line}.")
    for pair, sets in result.items():
        for s, r in sets.items():
            lines.append(f"| {pair} | {s} | {' '.join(f'{x:.3f}' for x in r['ratios'])} | "
                         f"{r['ratio_mean']:.3f} ± {r['ratio_sd']:.3f} | {r['pooled_diff']:+.3f} "
                         f"({r['pooled_ci95'][0]:+.3f}, {r['pooled_ci95'][1]:+.3f}), n={r['n']} | "
                         f"{r['wins']}/{r['losses']} |")
    out = Path(args.out)
    with atomic_path(out) as t:
        t.write_text("\n".join(lines) + "\n")
    with atomic_path(out.with_suffix(".json")) as t:
        t.write_text(json.dumps(result, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    run_cli(main)
