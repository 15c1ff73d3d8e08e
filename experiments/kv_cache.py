"""The decoders' K/V cache: the growing layer (preallocated buffer, a step writes only its new positions) against
Hugging Face's DynamicLayer (`torch.cat` of the whole cache every forward), decoding the same prompts both ways in
interleaved rounds: batched decoding at several batch sizes (plain and with a drafter, its adaptive draft count)
and batch-1 chain decoding. Outputs must be identical; tokens/s is the median over rounds, the ratio the median of
the per-round ratios.

    python experiments/kv_cache.py --out experiments/results/kv_cache
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from domino_lab import speculative_generate
from domino_lab.config import repo_root
from domino_lab.data.eval_sets import load_eval_set
from domino_lab.decoding import kv_cache
from domino_lab.decoding.batched import batched_generate
from domino_lab.errors import CliParser, UserError, atomic_path, check_out_dir, run_cli
from domino_lab.models import load_drafter
from domino_lab.target import Target, cpu_line, use_decode_threads


def decode(target, drafter, prompts, size, max_new):
    """(tokens, seconds, outputs) of decoding `prompts`: batches of `size` (0 = the batch-1 engine)."""
    outs, wall = [], 0.0
    if size == 0:
        for p in prompts:
            res = speculative_generate(target, drafter, prompt_ids=p, max_new_tokens=max_new)
            outs.append(res.token_ids)
            wall += res.wall_time_s
    else:
        for i in range(0, len(prompts), size):
            res = batched_generate(target, drafter, prompts[i:i + size], max_new_tokens=max_new)
            outs += res.token_ids
            wall += res.wall_time_s
    return sum(map(len, outs)), wall, outs


def main(argv=None) -> int:
    p = CliParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="default")
    p.add_argument("--drafter", default="default")
    p.add_argument("--sets", nargs="+", default=["math", "humaneval"])
    p.add_argument("--limit", type=int, default=16, help="prompts per set for batched decoding")
    p.add_argument("--engine-limit", type=int, default=6, help="prompts per set for batch-1 chain decoding")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[4, 16])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the decoders' choice)")
    p.add_argument("--out", default=None, help="folder for kv_cache.md / kv_cache.json (default: print only)")
    a = p.parse_args(argv)
    if a.rounds < 1 or a.limit < 1 or a.engine_limit < 0 or a.max_new_tokens < 1 or min(a.batch_sizes) < 1:
        raise UserError("--rounds, --limit, --max-new-tokens and --batch-sizes must be >= 1, --engine-limit >= 0")
    out = None if a.out is None else check_out_dir(a.out if Path(a.out).is_absolute() else repo_root() / a.out)
    sets = {s: load_eval_set(s, limit=a.limit) for s in a.sets}
    target = Target.from_pretrained(a.target)
    use_decode_threads(target, a.threads)
    drafter = load_drafter(a.drafter, target)
    ids = {s: [target.encode(x["prompt"]) for x in rows] for s, rows in sets.items()}
    configs = [(s, size, m) for s in sets for size in a.batch_sizes + ([0] if a.engine_limit else [])
               for m in ("ar", "domino")]
    kinds = list(kv_cache.KINDS)
    speed = {(c, k): [] for c in configs for k in kinds}
    equal = {c: True for c in configs}
    decode(target, drafter, ids[a.sets[0]][:2], 2, 8)                 # warm-up (and the fused head's build)
    t0 = time.perf_counter()
    for r in range(a.rounds):
        for c in configs:
            s, size, m = c
            prompts = ids[s] if size else ids[s][: a.engine_limit]
            outs = {}
            for k in (kinds if r % 2 == 0 else kinds[::-1]):
                with kv_cache.kind(k):
                    toks, wall, outs[k] = decode(target, drafter if m == "domino" else None, prompts, size,
                                                 a.max_new_tokens)
                speed[(c, k)].append(toks / wall)
            equal[c] &= outs[kinds[0]] == outs[kinds[1]]
    elapsed = time.perf_counter() - t0

    def ratio(x, y):
        return statistics.median(u / v for u, v in zip(x, y))

    rows, lines = [], []
    for c in configs:
        s, size, m = c
        g, d = speed[(c, "growing")], speed[(c, "dynamic")]
        row = {"set": s, "batch": size or 1, "decoder": "engine" if size == 0 else "batched", "method": m,
               "tokens_per_s": {"growing": statistics.median(g), "dynamic": statistics.median(d)},
               "rounds": {"growing": g, "dynamic": d}, "growing_vs_dynamic": ratio(g, d), "identical": equal[c]}
        if m == "domino":
            ar = (s, size, "ar")
            row["vs_ar"] = {k: ratio(speed[(c, k)], speed[(ar, k)]) for k in kinds}
        rows.append(row)
    cmd = "python experiments/kv_cache.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines += [
        "# K/V cache: growing buffer vs Hugging Face's DynamicLayer", "", f"`{cmd}`", "",
        f"Machine: {cpu_line()}, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}; {a.rounds} interleaved rounds, {elapsed:.0f} s. Target `{a.target}`, "
        f"drafter `{a.drafter}` (batched: its adaptive draft count); {a.limit} prompts per set batched, "
        f"{a.engine_limit} through the batch-1 engine; {a.max_new_tokens} new tokens.", "",
        "| set | decoder | batch | method | tok/s growing | tok/s dynamic | growing ÷ dynamic | Domino ÷ ar "
        "(growing / dynamic) | identical |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        vs = row.get("vs_ar")
        lines.append(f"| {row['set']} | {row['decoder']} | {row['batch']} | {row['method']} | "
                     f"{row['tokens_per_s']['growing']:.1f} | {row['tokens_per_s']['dynamic']:.1f} | "
                     f"{row['growing_vs_dynamic']:.3f}× | "
                     f"{'%.3f / %.3f' % (vs['growing'], vs['dynamic']) if vs else '–'} | "
                     f"{'yes' if row['identical'] else 'NO'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if out is not None:
        with atomic_path(out / "kv_cache.md") as t:
            t.write_text(text)
        with atomic_path(out / "kv_cache.json") as t:
            t.write_text(json.dumps({"command": cmd, "rows": rows}, indent=1))
    return 0 if all(equal.values()) else 1


if __name__ == "__main__":
    run_cli(main)
