"""What the Domino head adds, counted on identical texts: every step of a greedy decode beside its backbone alone.

    python experiments/same_text.py --sets math humaneval code unseen --limit 32 --out experiments/results/same_text
    python experiments/same_text.py --sets math --limit 2 --max-new-tokens 24 --out /tmp/x         # tests

Switching the head off and decoding the prompt again compares two texts that part at their first different step.
Here each verify step of the head-on decode is drafted again from exactly its text by the same drafter with the
head off (domino_lab.decoding.same_text), so a step's two counts differ only by the head. Reported per set:

- τ with the head, and τ of its backbone alone on the same steps; their ratio, and the per-prompt difference with
  a 95% Student-t interval (the prompts are the independent units); steps where the head committed more / fewer;
- the usual measurement beside it: the backbone alone decoding the prompt itself (its own text), and that ratio;
- with --baseline (default `default-dflash`), that drafter's τ decoding the same prompts, and Domino's τ over it,
  which is exactly Domino's τ over its backbone decoding alone times that backbone's τ over the baseline's (how
  much the backbone trained under the head drafts worse or better alone than the baseline does);
- per draft slot, where the two blocks first differ: how often the head's draft there was accepted while the
  backbone's was rejected (the head fixed that slot), and the reverse (the head broke it).

`--report DIR` decodes nothing: it recomputes DIR/same_text.{json,md} from the per-prompt counts saved there.
"""
from __future__ import annotations

import argparse
import time

from domino_lab.cli_flags import add_threads_arg
from domino_lab.errors import CliParser, UserError, check_out_dir, run_cli


def first_difference(pair) -> tuple[int | None, str]:
    """The first slot where the head's and the backbone's drafts differ, and what verification made of it: "fixed"
    (the head's draft accepted there, the backbone's not), "broke" (the reverse) or "neither" (both rejected at or
    before it); (None, "same") when the blocks agree."""
    on, off = pair.on, pair.off
    j = next((k for k, (a, b) in enumerate(zip(on.draft_tokens, off.draft_tokens)) if a != b), None)
    if j is None:
        return None, "same"
    if j < on.accepted:
        return j, "fixed"
    if j < off.accepted:
        return j, "broke"
    return j, "neither"


def measure(target, drafter, prompts: list[dict], max_new_tokens: int, baseline=None) -> dict:
    """Per prompt: the head-on decode's steps and tokens, the same steps' tokens by the backbone alone, the
    backbone's own decode of the prompt (and the baseline drafter's); per slot, the first differences and their
    outcomes."""
    from domino_lab import speculative_generate
    from domino_lab.decoding.engine import prompt_token_ids
    from domino_lab.decoding.same_text import backbone_alone, pair_steps, tally

    off_drafter = backbone_alone(drafter)
    rows, slots = [], {}
    for p in prompts:
        ids = prompt_token_ids(target, p["prompt"])
        on = speculative_generate(target, drafter, prompt_ids=ids, max_new_tokens=max_new_tokens)
        own = speculative_generate(target, off_drafter, prompt_ids=ids, max_new_tokens=max_new_tokens)
        base = (speculative_generate(target, baseline, prompt_ids=ids, max_new_tokens=max_new_tokens)
                if baseline is not None else None)
        if own.token_ids != on.token_ids or (base is not None and base.token_ids != on.token_ids):
            raise RuntimeError(f"prompt {p['id']}: the drafters' texts differ: the decoder is not lossless")
        pairs = pair_steps(target, drafter, ids, on, max_new_tokens)
        for pair in pairs:
            j, what = first_difference(pair)
            if j is not None:
                slots.setdefault(j, {"fixed": 0, "broke": 0, "neither": 0})[what] += 1
        rows.append({"id": p["id"], **tally(pairs),
                     "own_steps": len(own.steps), "own_tokens": sum(own.acceptance_lengths),
                     **({"baseline_steps": len(base.steps), "baseline_tokens": sum(base.acceptance_lengths)}
                        if base else {})})
    return {"per_prompt": rows, "slots": {j: slots[j] for j in sorted(slots)}}


def summary(res: dict) -> dict:
    from domino_lab.evaluate import t_interval

    rows = [r for r in res["per_prompt"] if r["steps"] > 0 and r["own_steps"] > 0]
    if not rows:
        raise UserError("no prompt of the set took a verify step (each text ended at its first token); use other "
                        "prompts or more --max-new-tokens")
    steps = sum(r["steps"] for r in rows)
    tau_on = sum(r["on_tokens"] for r in rows) / steps
    tau_off = sum(r["off_tokens"] for r in rows) / steps
    tau_own = sum(r["own_tokens"] for r in rows) / sum(r["own_steps"] for r in rows)
    mean, lo, hi = t_interval([(r["on_tokens"] - r["off_tokens"]) / r["steps"] for r in rows])
    extra = {}
    if all("baseline_steps" in r for r in rows):
        tau_base = sum(r["baseline_tokens"] for r in rows) / max(sum(r["baseline_steps"] for r in rows), 1)
        extra = {"tau_baseline": tau_base, "ratio_baseline": tau_on / tau_base,
                 "backbone_own_over_baseline": tau_own / tau_base}
    return {**extra, "prompts": len(rows), "steps": steps, "tau_on": tau_on, "tau_off_same_text": tau_off,
            "ratio_same_text": tau_on / tau_off, "diff_per_prompt": mean, "ci95": [lo, hi],
            "steps_more": sum(r["more"] for r in rows), "steps_fewer": sum(r["fewer"] for r in rows),
            "tau_off_own_text": tau_own, "ratio_own_text": tau_on / tau_own}


def report(results: dict, command: str, machine: str) -> str:
    lines = ["# What the Domino head adds on identical texts", "",
             f"`{command}` — {machine}; drafter `{results['drafter']}`, greedy, {results['max_new_tokens']} new "
             "tokens per prompt.", "",
             "τ with the head, and τ of its backbone alone drafting the very same steps (each step drafted again from "
             "the head-on decode's text with the head off); beside them, the backbone alone decoding each prompt "
             "itself, the usual head-off measurement, whose text parts from the head-on one after their first "
             "different step. Δτ per prompt: the mean over prompts of (tokens with the head − without) ÷ steps, "
             "with its 95% t-interval.", "",
             "| set | prompts | steps | τ with the head | τ backbone alone, same steps | ratio | Δτ per prompt (95% CI) "
             "| steps the head committed more / fewer | τ backbone alone, own decode | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["sets"].items():
        s = r["summary"]
        lines.append(f"| {name} | {s['prompts']} | {s['steps']} | {s['tau_on']:.3f} | {s['tau_off_same_text']:.3f} | "
                     f"{s['ratio_same_text']:.3f} | {s['diff_per_prompt']:+.3f} ({s['ci95'][0]:+.3f}, "
                     f"{s['ci95'][1]:+.3f}) | {s['steps_more']} / {s['steps_fewer']} | "
                     f"{s['tau_off_own_text']:.3f} | {s['ratio_own_text']:.3f} |")
    if results.get("baseline"):
        lines += ["", f"Against the baseline `{results['baseline']}` decoding the same prompts: Domino's τ over the "
                  "baseline's is Domino's τ over its backbone decoding alone times that backbone's τ over the "
                  "baseline's. (The same-steps ratio above is not a factor of it: the head-on decode's steps start at "
                  "other positions than a decode of the backbone alone, which moves τ by itself.)",
                  "", "| set | τ baseline | Domino ÷ baseline | = Domino ÷ its backbone decoding alone | × its backbone "
                  "decoding alone ÷ baseline |", "|---|---|---|---|---|"]
        for name, r in results["sets"].items():
            s = r["summary"]
            lines.append(f"| {name} | {s['tau_baseline']:.3f} | {s['ratio_baseline']:.3f} | "
                         f"{s['ratio_own_text']:.3f} | {s['backbone_own_over_baseline']:.3f} |")
    lines += ["", "Where the head's block first differs from the backbone's, by draft slot (1 = the first draft): "
              "fixed = the head's draft there was accepted and the backbone's would have been rejected; broke = the "
              "reverse; neither = both rejected at or before it.", "",
              "| slot | " + " | ".join(f"{name}: fixed / broke / neither" for name in results["sets"]) + " |",
              "|---|" + "---|" * len(results["sets"])]
    for j in range(results["slots"]):
        cells = []
        for r in results["sets"].values():
            c = r["slots"].get(j) or r["slots"].get(str(j)) or {"fixed": 0, "broke": 0, "neither": 0}
            cells.append(f"{c['fixed']} / {c['broke']} / {c['neither']}")
        lines.append(f"| {j + 1} | " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import sys

    p = CliParser(prog="python experiments/same_text.py", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="default")
    p.add_argument("--drafter", default="default", help="a drafter with a Domino head (shipped name or directory)")
    p.add_argument("--baseline", default="default-dflash",
                   help="a drafter to decode the same prompts with, for Domino's τ over it ('none' to skip)")
    p.add_argument("--sets", nargs="+", default=["math", "humaneval", "code", "unseen"])
    p.add_argument("--limit", type=int, default=32, help="prompts per set")
    p.add_argument("--max-new-tokens", type=int, default=128)
    add_threads_arg(p)
    p.add_argument("--out", help="folder for same_text.{md,json}")
    p.add_argument("--report", metavar="DIR",
                   help="decode nothing: recompute DIR/same_text.{json,md} from the per-prompt counts saved there")
    args = p.parse_args(argv)
    if args.report:
        return rewrite_report(args.report)
    if not args.out:
        raise UserError("--out is required (a folder for same_text.{md,json}), unless --report DIR")
    if min(args.limit, args.max_new_tokens) < 1:
        raise UserError("--limit and --max-new-tokens must be >= 1")
    out = check_out_dir(args.out)

    from domino_lab import Target
    from domino_lab.data.eval_sets import load_eval_set
    from domino_lab.experiments.results import write_results
    from domino_lab.decoding.same_text import load_with_baseline
    from domino_lab.target import machine_line, use_decode_threads

    sets = {s: load_eval_set(s, limit=args.limit) for s in args.sets}
    target = Target.from_pretrained(args.target, dtype="float32")
    use_decode_threads(target, args.threads)
    drafter, baseline = load_with_baseline(target, args.drafter, args.baseline)
    command = "python experiments/same_text.py " + " ".join(argv if argv is not None else sys.argv[1:])
    results = {"command": command.strip(), "machine": machine_line(),
               "drafter": args.drafter, "baseline": None if baseline is None else args.baseline,
               "max_new_tokens": args.max_new_tokens, "slots": drafter.config.num_drafts,
               "sets": {}}
    t0 = time.perf_counter()
    for name, prompts in sets.items():
        res = measure(target, drafter, prompts, args.max_new_tokens, baseline)
        res["summary"] = summary(res)
        results["sets"][name] = res
        s = res["summary"]
        print(f"{name}: τ {s['tau_on']:.3f} with the head, {s['tau_off_same_text']:.3f} without on the same steps "
              f"({s['ratio_same_text']:.3f}×), {s['tau_off_own_text']:.3f} decoding alone", file=sys.stderr)
    results["seconds"] = round(time.perf_counter() - t0, 1)
    write_results(out, "same_text", results, report(results, results["command"], results["machine"]))
    return 0


def rewrite_report(folder: str) -> int:
    """`--report DIR`: the summaries and the markdown again from DIR/same_text.json's per-prompt counts."""
    import json
    from pathlib import Path

    from domino_lab.experiments.results import write_results

    path = Path(folder) / "same_text.json"
    try:
        results = json.loads(path.read_text())
        sets = results["sets"]
        command, machine = results["command"], results["machine"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--report {folder}: no same_text.json with per-prompt counts and the run's command to "
                        f"recompute from ({type(e).__name__}: {e}); run the experiment with --out first") from None
    for r in sets.values():
        r["summary"] = summary(r)
    write_results(folder, "same_text", results, report(results, command, machine))
    return 0


if __name__ == "__main__":
    run_cli(main)
