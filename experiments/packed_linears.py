"""Linear layers through oneDNN's packed weights against MKL's products (models/packed_linear.py), per product and in
decoding.

    python experiments/packed_linears.py                      # -> experiments/results/packed_linears/
    python experiments/packed_linears.py --quick --out /tmp/pl   (tests: 1 prompt, 12 tokens, 1 round)

Products: every distinct weight shape of the target's and the drafters' linear layers (and the drafters' FR-Spec
slice of the LM head), at 1 to 64 rows: MKL (`F.linear`, what PyTorch calls) against oneDNN's product with the
weight packed once, interleaved rounds, medians of wall time; beside them, the fewest rows from which `auto`
(the default) takes the packed product for that shape on this machine.

Decoding: plain decoding (`ar`) and every drafter configuration, each prompt decoded under `aten` (every product
through MKL: the engine before packed linears) and `auto`, alternating which goes first by prompt and round, greedy.
Per configuration: its tokens/s under auto over aten per prompt (geometric mean, Student-t 95% interval over the
prompts, wins / losses), and its speed-up over plain decoding under each mode; every text is checked against plain
decoding under the same mode (lossless) and against the other mode's (the kernels differ in the last bits, which
could only show where two tokens' logits tie to rounding).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch

from domino_lab.cli_flags import add_threads_arg
from domino_lab.errors import CliParser, UserError, check_out_dir, run_cli
from domino_lab.experiments.results import write_results
from domino_lab.models.options import drafter_items

MODES = ("aten", "auto")
ROWS = (1, 2, 8, 9, 16, 33, 64)


def parse_args(argv=None) -> argparse.Namespace:
    p = CliParser(prog="python experiments/packed_linears.py", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="default")
    p.add_argument("--drafter", action="append", default=None, metavar="LABEL=SPEC",
                   help="a chain configuration (repeatable; default domino=default and dflash=default-dflash)")
    p.add_argument("--tree", action="append", default=None, metavar="LABEL=SPEC",
                   help="a configuration decoded with --tree-nodes (repeatable; default "
                        "domino-tree=default@tree_min_prob=0.05)")
    p.add_argument("--tree-nodes", type=int, default=32)
    p.add_argument("--sets", nargs="+", default=["math", "humaneval", "code", "unseen", "fresh"])
    p.add_argument("--limit", type=int, default=12, help="prompts per set")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=2, help="decodes of every prompt by each configuration and mode")
    p.add_argument("--quick", action="store_true", help="1 prompt of one set, 12 tokens, 1 round, few timings")
    add_threads_arg(p)
    p.add_argument("--out", default="experiments/results/packed_linears")
    a = p.parse_args(argv)
    a.drafter = a.drafter or ["domino=default", "dflash=default-dflash"]
    a.tree = a.tree if a.tree is not None else ["domino-tree=default@tree_min_prob=0.05"]
    a.items = drafter_items(a.drafter + a.tree, flag="--drafter/--tree")     # bad items fail before any model loads
    a.trees = {it.label for it in a.items[len(a.drafter):]}
    if a.quick:
        a.sets, a.limit, a.max_new_tokens, a.rounds = a.sets[:1], 1, 12, 1
    if min(a.limit, a.max_new_tokens, a.rounds, a.tree_nodes) < 1:
        raise UserError("--limit, --max-new-tokens, --rounds and --tree-nodes must be >= 1")
    check_out_dir(a.out, "--out")
    return a


def product_times(weights: dict, rounds: int, quick: bool) -> dict:
    """{shape: {rows: {"aten": ms, "packed": ms}}} for each weight of `weights` ({"out x in": tensor}), timed as
    `auto` times its choice (packed_linear.time_products)."""
    from domino_lab.models.packed_linear import time_products

    g = torch.Generator().manual_seed(0)
    return {name: {rows: {k: 1e3 * v for k, v in time_products(w, None, rows, rounds, g).items()}
                   for rows in (ROWS[:2] if quick else ROWS)} for name, w in weights.items()}


def decode(args, target, drafters: dict, sets: dict) -> dict:
    from domino_lab import speculative_generate
    from domino_lab.models import packed_linear as pl

    configs = {"ar": (None, 0)} | {lab: (d, args.tree_nodes if lab in args.trees else 0) for lab, d in drafters.items()}
    res = {}
    for s, prompts in sets.items():
        ids = [target.encode(p["prompt"]) for p in prompts]
        for m in MODES:                                   # warm-up: auto measures its shapes here
            pl.set_mode(m)
            for d, n in configs.values():
                speculative_generate(target, d, prompt_ids=ids[0], max_new_tokens=args.max_new_tokens, tree_nodes=n)
        wall = {(c, m): [0.0] * len(ids) for c in configs for m in MODES}
        tokens = {(c, m): [0] * len(ids) for c in configs for m in MODES}
        steps = {(c, m): [0] * len(ids) for c in configs for m in MODES}
        lossless, same_across = {c: 0 for c in configs}, {c: 0 for c in configs}
        for r in range(args.rounds):
            for i, x in enumerate(ids):
                texts = {}
                for m in MODES if (i + r) % 2 == 0 else MODES[::-1]:
                    pl.set_mode(m)
                    for c, (d, n) in configs.items():
                        out = speculative_generate(target, d, prompt_ids=x, max_new_tokens=args.max_new_tokens,
                                                   tree_nodes=n)
                        wall[c, m][i] += out.wall_time_s
                        tokens[c, m][i] += len(out.token_ids)
                        steps[c, m][i] += len(out.steps)
                        texts[c, m] = out.token_ids
                for c in configs:
                    lossless[c] += all(texts[c, m] == texts["ar", m] for m in MODES)
                    same_across[c] += texts[c, "aten"] == texts[c, "auto"]
        res[s] = summarize(configs, wall, tokens, steps, args.rounds, len(ids) * args.rounds, lossless, same_across)
    return res


def _geo(logs: list[float]) -> dict:
    from domino_lab.evaluate import t_interval

    m, lo, hi = t_interval(logs)
    return {"geomean": math.exp(m), "ci95": [math.exp(lo), math.exp(hi)],
            "wins": sum(v > 0 for v in logs), "losses": sum(v < 0 for v in logs)}


def summarize(configs, wall, tokens, steps, rounds: int, decodes: int, lossless, same_across) -> dict:
    tps = {k: [t / w for t, w in zip(tokens[k], wall[k])] for k in wall}
    out = {}
    for c in configs:
        r = {"auto_over_aten": _geo([math.log(b / a) for a, b in zip(tps[c, "aten"], tps[c, "auto"])]),
             "tokens_per_s": {m: sum(tokens[c, m]) / sum(wall[c, m]) for m in MODES},
             "decodes": decodes, "lossless": lossless[c], "same_text_across_modes": same_across[c],
             "per_prompt_tokens_per_s": {m: tps[c, m] for m in MODES}}
        if c != "ar":
            r["over_ar"] = {m: _geo([math.log(b / a) for a, b in zip(tps["ar", m], tps[c, m])]) for m in MODES}
            r["tau"] = statistics.fmean((t - rounds) / max(1, n) for t, n in zip(tokens[c, "auto"], steps[c, "auto"]))
        out[c] = r
    return out


def markdown(res: dict, meta: dict) -> str:
    lines = ["# Packed linear layers (oneDNN) against MKL's products", "", f"`{meta['command']}`", "",
             f"{meta['machine']}; {meta['date']}; {meta['wall_s']} s.", "",
             "## Products", "",
             f"ms per product, medians of wall time over {meta['product_rounds']} interleaved rounds; MKL / packed "
             "(ratio). `auto` takes the packed product from the row count in the last column on (measured at "
             "1, 8 and 64 rows when the process first meets the shape).", ""]
    rows = sorted({r for t in res["products"].values() for r in t}, key=int)
    heads = [f"{r} row{'s' * (int(r) > 1)}" for r in rows]
    lines += ["| weight (out × in) | " + " | ".join(heads) + " | auto: packed from |", "|" + "---|" * (len(rows) + 2)]
    # auto's choices by pl.shape_name ('OUTxIN', '+bias' where the layer has one); the products are timed by shape
    auto = {k.removesuffix("+bias"): v for k, v in res["auto_choice"].items()}
    for name, t in res["products"].items():
        cells = [f"{t[r]['aten']:.3f} / {t[r]['packed']:.3f} ({t[r]['packed'] / t[r]['aten']:.2f})" for r in rows]
        key = name.replace(" × ", "x")
        first = auto.get(key)
        choice = ("not called as a linear layer" if key not in auto else "never" if first is None
                  else f"{first} row{'s' * (first > 1)}")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {choice} |")
    lines += ["", "## Decoding", "",
              f"Greedy, {meta['limit']} prompts per set, {meta['max_new_tokens']} new tokens, {meta['rounds']} "
              f"round(s); trees: {meta['tree_nodes']} nodes. Per prompt, tokens/s under `auto` over `aten` (geometric "
              "mean over prompts, Student-t 95% interval, wins / losses); speed-up over `ar` per prompt under each "
              "mode; lossless: decodes whose text equals plain decoding's under both modes; same text: decodes "
              "whose text is the same under both modes.", "",
              "| set | configuration | τ | tokens/s aten → auto | auto ÷ aten | 95% CI | wins / losses "
              "| ÷ ar, aten | ÷ ar, auto | lossless | same text |", "|" + "---|" * 11]
    for s, cfgs in res["decoding"].items():
        for c, r in cfgs.items():
            g, tp = r["auto_over_aten"], r["tokens_per_s"]
            over = [f"{r['over_ar'][m]['geomean']:.2f}" if "over_ar" in r else "1" for m in MODES]
            lines.append(f"| {s} | {c} | {r['tau']:.2f} | " if "tau" in r else f"| {s} | {c} | – | ")
            lines[-1] += (f"{tp['aten']:.1f} → {tp['auto']:.1f} | {g['geomean']:.3f} | {g['ci95'][0]:.3f} – "
                          f"{g['ci95'][1]:.3f} | {g['wins']} / {g['losses']} | {over[0]} | {over[1]} | "
                          f"{r['lossless']}/{r['decodes']} | {r['same_text_across_modes']}/{r['decodes']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    from domino_lab import Target
    from domino_lab.data.eval_sets import load_eval_set
    from domino_lab.models import packed_linear as pl
    from domino_lab.models.drafter import load_item
    from domino_lab.target import machine_line, openmp_waits, use_decode_threads

    if not pl.available():
        raise UserError("this torch build has no oneDNN linear (torch.backends.mkldnn), so there is nothing to "
                        "compare; install a CPU build of torch with oneDNN (the default x86 and ARM builds have it)")
    started = time.time()
    sets = {s: load_eval_set(s, limit=args.limit) for s in args.sets}        # bad names fail before any model loads
    target = Target.from_pretrained(args.target)
    use_decode_threads(target, args.threads)
    drafters = {it.label: load_item(it, target) for it in args.items}
    weights = {}
    for mod in [target.model, *drafters.values()]:
        for m in mod.modules():
            if isinstance(m, pl.PackedLinear) and m.weight.dtype == torch.float32:
                weights.setdefault(f"{m.weight.shape[0]} × {m.weight.shape[1]}", m.weight.detach())
    for d in drafters.values():
        w, _ = d.draft_head_rows()
        weights.setdefault(f"{w.shape[0]} × {w.shape[1]}", w.detach())
    product_rounds = 3 if args.quick else 9
    before = pl.mode()
    try:
        products = product_times(weights, product_rounds, args.quick)
        decoding = decode(args, target, drafters, sets)
    finally:
        pl.set_mode(before)
    choice = pl.choices()["packed_from"]       # what `auto` measured in this process, by pl.shape_name
    meta = {"command": " ".join(["python experiments/packed_linears.py", *(sys.argv[1:] if argv is None else argv)]),
            "machine": machine_line(openmp_waits()), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "wall_s": round(time.time() - started, 1), "product_rounds": product_rounds, "limit": args.limit,
            "max_new_tokens": args.max_new_tokens, "rounds": args.rounds, "tree_nodes": args.tree_nodes,
            "drafters": {it.label: it.spec for it in args.items}}
    res = {"products": products, "auto_choice": choice, "decoding": decoding}
    write_results(args.out, "packed_linears", {"meta": meta, **res}, markdown(res, meta))
    return 0


if __name__ == "__main__":
    run_cli(main)
