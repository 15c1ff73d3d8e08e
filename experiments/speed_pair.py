"""Tokens/s of two drafters, paired prompt by prompt: does one decode faster than the other, and by how much?

    python experiments/speed_pair.py --a domino=default --b dflash=default-dflash --sets math --limit 32 --rounds 3
    python experiments/speed_pair.py --a domino=default --b domino-fast=default@head_impl=fast --temperature 1

Greedy decoding is lossless, so both drafters emit the same tokens for a prompt and the ratio of their tokens/s on
it is the ratio of their wall times. Every prompt is decoded by both in every round, the order alternating by prompt
and round, so a slow spell of the machine falls on both. A prompt's ratio is a's tokens/s over b's, each pooled over
all rounds; the summary is the geometric mean over prompts with a Student-t 95% interval on the log ratios, and the
wins. A set's tokens/s over all its prompts (the bench's number) weighs long slow prompts more; it is reported
beside. With --temperature T > 0 round r samples with seed r for both drafters: their texts then differ (each is an
exact sample of the target), so a prompt's tokens/s pools every round's samples, and τ says how much each drafter
committed per step on them; with --sampler gumbel their texts are the same again (the seed fixes the text), and
--sampler-b compares two samplers. A SPEC may end in @key=value,... (inference options, as bench --drafter takes
them).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from domino_lab.cli_flags import SAMPLERS, add_sampler_arg, add_threads_arg
from domino_lab.errors import CliParser, UserError, atomic_path, check_out_dir, run_cli
from domino_lab.models.options import drafter_items


def parse_args(argv=None) -> argparse.Namespace:
    p = CliParser(prog="python experiments/speed_pair.py", description=__doc__.splitlines()[0])
    p.add_argument("--target", default="default")
    p.add_argument("--a", default="domino=default", metavar="LABEL=SPEC", help="the drafter whose speed-up is asked")
    p.add_argument("--b", default="dflash=default-dflash", metavar="LABEL=SPEC", help="the drafter it is compared to")
    p.add_argument("--sets", nargs="+", default=["math"])
    p.add_argument("--limit", type=int, default=32, help="prompts per set")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="decodes of every prompt by each drafter (at T > 0: seeds "
                   "0 .. rounds-1)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default); > 0 samples")
    add_sampler_arg(p)
    p.add_argument("--sampler-b", choices=SAMPLERS, default=None, help="--b's sampler when it differs from --a's")
    add_threads_arg(p)
    p.add_argument("--out", default=None, help="folder for speed_pair.{md,json} (default: print only)")
    p.add_argument("--report", default=None, metavar="DIR",
                   help="decode nothing: recompute DIR/speed_pair.{json,md} from the per-prompt counts saved there")
    a = p.parse_args(argv)
    a.items = drafter_items([a.a, a.b], flag="--a/--b")          # bad items fail before any model loads
    if min(a.limit, a.max_new_tokens, a.rounds) < 1:
        raise UserError("--limit, --max-new-tokens and --rounds must be >= 1")
    if not 0.0 <= a.temperature <= 10.0:
        raise UserError(f"--temperature must be in [0, 10] (0 = greedy), got {a.temperature}")
    # each label's sampler, by label
    a.samplers = {a.items[0].label: a.sampler, a.items[1].label: a.sampler_b or a.sampler}
    if a.out is not None:
        check_out_dir(a.out)
    return a


def run(args) -> dict:
    from domino_lab import Target, speculative_generate
    from domino_lab.data.eval_sets import load_eval_set
    from domino_lab.models.drafter import load_item
    from domino_lab.target import use_decode_threads

    sets = {s: load_eval_set(s, limit=args.limit) for s in args.sets}        # bad names fail before any model loads
    target = Target.from_pretrained(args.target)
    use_decode_threads(target, args.threads)
    drafters = {it.label: load_item(it, target) for it in args.items}
    la, lb = drafters
    # texts must match when greedy, or when both sample with Gumbel coupling (a function of the seed alone)
    check_same = args.temperature <= 0 or set(args.samplers.values()) == {"gumbel"}
    out = {}
    for s, prompts in sets.items():
        ids = [target.encode(p["prompt"]) for p in prompts]
        for d in drafters.values():                                          # warm-up
            speculative_generate(target, d, prompt_ids=ids[0], max_new_tokens=args.max_new_tokens)
        wall = {lab: [0.0] * len(ids) for lab in drafters}
        tokens = {lab: [0] * len(ids) for lab in drafters}
        steps = {lab: [0] * len(ids) for lab in drafters}
        same = []
        for r in range(args.rounds):
            for i, x in enumerate(ids):
                order = [la, lb] if (i + r) % 2 == 0 else [lb, la]
                res = {}
                for lab in order:
                    res[lab] = speculative_generate(target, drafters[lab], prompt_ids=x,
                                                    max_new_tokens=args.max_new_tokens,
                                                    temperature=args.temperature, seed=r,
                                                    sampler=args.samplers[lab])
                    wall[lab][i] += res[lab].wall_time_s
                    tokens[lab][i] += len(res[lab].token_ids)
                    steps[lab][i] += len(res[lab].steps)
                same.append(res[la].token_ids == res[lb].token_ids)
        per_prompt = [{"id": p.get("id", str(i)),
                       **{f"{k}_{lab}": v[lab][i] for lab in drafters
                          for k, v in (("tokens", tokens), ("wall_s", wall), ("steps", steps))}}
                      for i, p in enumerate(prompts)]
        out[s] = summarize(per_prompt, la, lb, args.rounds, all(same) if check_same else None)
    return out


def summarize(per_prompt: list[dict], la: str, lb: str, rounds: int, identical: bool | None) -> dict:
    """A set's result from its per-prompt counts (tokens, wall seconds and verify steps of each label, summed over
    the rounds): what `run` measured, and what `--report` recomputes from a saved JSON."""
    from domino_lab.evaluate import t_interval      # (torch: not loaded for --help)

    col = {lab: {k: [p[f"{k}_{lab}"] for p in per_prompt] for k in ("tokens", "wall_s", "steps")} for lab in (la, lb)}
    tps = {lab: [t / w for t, w in zip(c["tokens"], c["wall_s"])] for lab, c in col.items()}
    logs = [math.log(x / y) for x, y in zip(tps[la], tps[lb])]
    m, lo, hi = t_interval(logs)
    set_tps = {lab: sum(c["tokens"]) / sum(c["wall_s"]) for lab, c in col.items()}
    # per prompt, committed tokens per verify step pooled over the rounds (the prefill's token of each round is not
    # a step's), and a's minus b's
    tau = {lab: [(t - rounds) / max(1, n) for t, n in zip(c["tokens"], c["steps"])] for lab, c in col.items()}
    dtau = t_interval([x - y for x, y in zip(tau[la], tau[lb])])
    return {"prompts": len(per_prompt), "ratio_geomean": math.exp(m), "ci95": [math.exp(lo), math.exp(hi)],
            "wins": sum(x > 0 for x in logs), "losses": sum(x < 0 for x in logs),
            "set_ratio": set_tps[la] / set_tps[lb], "tokens_per_s": set_tps,
            "tau": {lab: statistics.fmean(tau[lab]) for lab in (la, lb)},
            "dtau": {"mean": dtau[0], "ci95": [dtau[1], dtau[2]]}, "identical": identical, "per_prompt": per_prompt}


def report(folder: str) -> int:
    """Recompute FOLDER/speed_pair.{json,md} from the per-prompt counts the JSON holds (after a change to how a
    summary is computed); the measurements themselves are not touched."""
    path = Path(folder) / "speed_pair.json"
    try:
        saved = json.loads(path.read_text())
        meta = saved["meta"]
        la, lb = meta["a"].partition("=")[0], meta["b"].partition("=")[0]
        res = {s: summarize(r["per_prompt"], la, lb, meta["rounds"], r["identical"])
               for s, r in saved["results"].items()}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--report {folder}: no speed_pair.json with per-prompt counts to recompute from (missing "
                        f"{e}; folders written before the counts were saved cannot be recomputed)") from None
    meta["recomputed"] = time.strftime("%Y-%m-%d %H:%M")
    with atomic_path(path) as t:
        t.write_text(json.dumps({"meta": meta, "results": res}, indent=1))
    with atomic_path(Path(folder) / "speed_pair.md") as t:
        t.write_text(markdown(res, la, lb, meta))
    return 0


def markdown(res: dict, la: str, lb: str, meta: dict) -> str:
    lines = [f"# Tokens/s of {la} over {lb}, paired per prompt", "", f"`{meta['command']}`", "",
             f"{meta['machine']}; {meta['date']}; {meta['wall_s']} s; {meta['rounds']} rounds, alternating order; "
             f"{_mode(meta)}, {meta['max_new_tokens']} new tokens"
             + (f"; summary recomputed {meta['recomputed']} from the saved counts" if "recomputed" in meta else ""),
             "", "τ: committed tokens per verify step of each prompt (the prefill's token left out), averaged over "
             "the prompts; CIs: Student t over the prompts.", "",
             f"| set | prompts | τ {la} | τ {lb} | per prompt {la} ÷ {lb} (geometric mean) | 95% CI | wins / losses "
             f"| over the set | tokens/s {la} | tokens/s {lb} | Δτ per prompt (95% CI) | same tokens |",
             "|" + "---|" * 12]
    for s, r in res.items():
        lines.append(f"| {s} | {r['prompts']} | {r['tau'][la]:.2f} | {r['tau'][lb]:.2f} | {r['ratio_geomean']:.3f} | "
                     f"{r['ci95'][0]:.3f} – {r['ci95'][1]:.3f} | {r['wins']} / {r['losses']} | {r['set_ratio']:.3f} | "
                     f"{r['tokens_per_s'][la]:.1f} | {r['tokens_per_s'][lb]:.1f} | "
                     f"{r['dtau']['mean']:+.3f} ({r['dtau']['ci95'][0]:+.3f}, {r['dtau']['ci95'][1]:+.3f}) | "
                     f"{_same(r['identical'])} |")
    return "\n".join(lines) + "\n"


def _mode(meta: dict) -> str:
    if meta["temperature"] <= 0:
        return "greedy"
    samplers = meta["samplers"]
    how = ", ".join(f"{lab}: {s}" for lab, s in samplers.items()) if len(set(samplers.values())) > 1 else \
        next(iter(samplers.values()))
    return f"sampled at T = {meta['temperature']:g} (round r: seed r; sampler {how})"


def _same(identical: bool | None) -> str:
    return "sampled" if identical is None else "yes" if identical else "NO"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        return report(args.report)
    from domino_lab.target import machine_line

    started = time.time()
    res = run(args)
    la, lb = args.a.partition("=")[0], args.b.partition("=")[0]
    meta = {"command": "python experiments/speed_pair.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": machine_line(), "date": time.strftime("%Y-%m-%d %H:%M"),
            "rounds": args.rounds, "max_new_tokens": args.max_new_tokens, "a": args.a, "b": args.b,
            "temperature": args.temperature,
            "samplers": args.samplers,
            "wall_s": round(time.time() - started, 1)}
    md = markdown(res, la, lb, meta)
    print(md)
    if args.out:
        out = Path(args.out)
        with atomic_path(out / "speed_pair.json") as t:
            t.write_text(json.dumps({"meta": meta, "results": res}, indent=1))
        with atomic_path(out / "speed_pair.md") as t:
            t.write_text(md)
    return 0 if all(r["identical"] is not False for r in res.values()) else 1


if __name__ == "__main__":
    run_cli(main)
