"""Where a drafter loses to copying: each chain step classified by what prompt lookup would have drafted there.

    python experiments/copy_gap.py                                   # shipped drafters, 4 sets, writes experiments/results/copy_gap.*
    python experiments/copy_gap.py --quick --out /tmp/copy_gap       # 2 prompts, 16 tokens (a smoke test)
    python experiments/copy_gap.py --drafter domino=runs/train/domino/best --sets humaneval

Every drafter decodes each prompt greedily alone (no lookup drafting). At each of its verify steps the text so far
(prompt + committed tokens up to the anchor) is asked what an n-gram copier (`NgramLookup`, fixed match length
`--min-ngram`, as `hf-prompt-lookup` and the engine's lookup drafting use it) would propose, and that proposal is
compared with the target's own continuation, known from the decode. A step is then

- `copy right`: the copier proposes and its first token is the target's next token (the text is quoting itself:
  a loop, or a name or phrase the prompt already holds);
- `copy wrong`: the copier proposes, but not what the target writes;
- `no copy`: the text's suffix never occurred before.

Per class: its share of the steps, the drafter's first-draft acceptance and accepted drafts per step, and the
tokens the copy would have had accepted (its common prefix with the target's continuation, at most the block).
Greedy decoding is deterministic, so this measures acceptance only; no timing. Every decode is checked against
plain greedy decoding.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from domino_lab.errors import CliParser, UserError, atomic_path, check_out_dir, run_cli  # noqa: E402

CLASSES = ("no copy", "copy right", "copy wrong")
DEFAULT_DRAFTERS = ["dflash=default-dflash", "domino=default"]


def parse_args(argv=None) -> argparse.Namespace:
    p = CliParser(prog="python experiments/copy_gap.py", description=__doc__.splitlines()[0])
    p.add_argument("--target", default="default")
    p.add_argument("--drafter", action="append", default=None, metavar="LABEL=SPEC",
                   help="a drafter to classify (repeat); default: " + " ".join(DEFAULT_DRAFTERS))
    p.add_argument("--sets", nargs="+", default=["math", "humaneval", "code", "unseen"])
    p.add_argument("--limit", type=int, default=16, help="prompts per set")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--min-ngram", type=int, default=3, help="the copier's suffix match length (as --lookup N)")
    p.add_argument("--out", default=str(ROOT / "experiments" / "results"), help="folder for copy_gap.{md,json}")
    p.add_argument("--quick", action="store_true", help="2 prompts per set, 16 new tokens (smoke test)")
    args = p.parse_args(argv)
    check_out_dir(args.out)
    if args.quick:
        args.limit, args.max_new_tokens = min(args.limit, 2), min(args.max_new_tokens, 16)
    if min(args.limit, args.max_new_tokens, args.min_ngram) < 1:
        raise UserError("--limit, --max-new-tokens and --min-ngram must be >= 1")
    args.drafter = args.drafter or DEFAULT_DRAFTERS
    labels = [d.partition("=")[0] for d in args.drafter]
    if any("=" not in d or not d.partition("=")[2] for d in args.drafter) or len(set(labels)) != len(labels):
        raise UserError(f"--drafter takes LABEL=SPEC with distinct labels, got {args.drafter}")
    return args


def classify(steps, text: list[int], min_ngram: int) -> list[dict]:
    """One row per verify step: its class, the drafter's accepted drafts, and the copy's accepted length. `text` is
    the prompt followed by everything the decode committed; step.start is the anchor's position in it."""
    from domino_lab.decoding.lookup import NgramLookup

    rows = []
    for st in steps:
        n = len(st.draft_tokens)
        if n == 0:
            continue                               # the last step of a budget drafts nothing: nothing to compare
        seen = text[: st.start + 1]                # up to and including the anchor
        proposal, _ = NgramLookup(min_ngram, seen, adaptive=False).propose(n)
        truth = text[st.start + 1: st.start + 1 + n]
        copied = 0
        for a, b in zip(proposal, truth):
            if a != b:
                break
            copied += 1
        kind = CLASSES[0] if not proposal else CLASSES[1] if copied else CLASSES[2]
        rows.append({"class": kind, "accepted": st.accepted, "copy": copied})
    return rows


def tally(rows: list[dict]) -> dict:
    out = {}
    for kind in CLASSES:
        rs = [r for r in rows if r["class"] == kind]
        k = len(rs)
        out[kind] = {"steps": k, "share": k / len(rows) if rows else 0.0,
                     "first_accepted": sum(r["accepted"] > 0 for r in rs) / k if k else None,
                     "accepted_per_step": sum(r["accepted"] for r in rs) / k if k else None,
                     "copy_per_step": sum(r["copy"] for r in rs) / k if k else None}
    return out


def run(args) -> dict:
    from domino_lab import Target, speculative_generate
    from domino_lab.data.eval_sets import load_eval_set
    from domino_lab.models import load_drafter

    sets = {s: load_eval_set(s, limit=args.limit) for s in args.sets}       # bad names fail before any model loads
    target = Target.from_pretrained(args.target)
    drafters = {}
    for item in args.drafter:
        label, _, spec = item.partition("=")
        drafters[label] = load_drafter(spec, target)
    results: dict = {}
    for s, prompts in sets.items():
        ids = [target.encode(p["prompt"]) for p in prompts]
        ref = [speculative_generate(target, None, prompt_ids=x, max_new_tokens=args.max_new_tokens).token_ids
               for x in ids]
        for label, d in drafters.items():
            rows, equal = [], 0
            for x, want in zip(ids, ref):
                res = speculative_generate(target, d, prompt_ids=x, max_new_tokens=args.max_new_tokens)
                equal += res.token_ids == want
                rows += classify(res.steps, x + res.token_ids, args.min_ngram)
            results.setdefault(s, {})[label] = {"classes": tally(rows), "steps": len(rows),
                                                "lossless": equal, "prompts": len(ids)}
    return results


def table(results: dict) -> str:
    from domino_lab.bench import _fmt as _f

    lines = ["| set | drafter | step class | share of steps | first draft accepted | drafts accepted / step | "
             "copy accepted / step |", "|" + "---|" * 7]
    for s, per in results.items():
        for label, r in per.items():
            for kind in CLASSES:
                c = r["classes"][kind]
                if not c["steps"]:
                    continue
                lines.append(f"| {s} | {label} | {kind} | {_f(c['share'])} | {_f(c['first_accepted'])} | "
                             f"{_f(c['accepted_per_step'])} | {_f(c['copy_per_step'])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    from domino_lab.target import machine_line

    started = time.time()
    results = run(args)
    meta = {"command": "python experiments/copy_gap.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": machine_line(),
            "date": time.strftime("%Y-%m-%d %H:%M"), "drafters": args.drafter, "limit": args.limit,
            "max_new_tokens": args.max_new_tokens, "min_ngram": args.min_ngram,
            "wall_s": round(time.time() - started, 1)}
    out = Path(args.out)
    with atomic_path(out / "copy_gap.json") as t:
        t.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    bad = [f"{s}/{k}" for s, per in results.items() for k, r in per.items() if r["lossless"] != r["prompts"]]
    md = table(results)
    with atomic_path(out / "copy_gap.md") as t:
        t.write_text(f"# Where the drafters lose to copying\n\n`{meta['command']}`\n\n{meta['machine']}; {meta['date']}; "
                     f"{meta['wall_s']} s; {args.limit} prompts per set, {args.max_new_tokens} new tokens, copier "
                     f"match length {args.min_ngram}\n\n{md}\n\n"
                     + (f"**Output differs from plain decoding for {bad}.**\n" if bad else
                        "Every decode equals plain greedy decoding.\n"))
    print(md)
    print(f"wrote {out / 'copy_gap.md'} and {out / 'copy_gap.json'}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    run_cli(main)
