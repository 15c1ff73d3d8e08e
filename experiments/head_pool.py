"""How large must the Domino head's candidate pool be? τ and per-slot draft agreement vs the exact head.

    python experiments/head_pool.py                        # -> experiments/results/head_pool.md / .json
    python experiments/head_pool.py --quick --out /tmp/x   # tests

For each pool size K the shipped `default` drafter decodes the eval prompts greedily with `head_impl=fast`
(K = 0 is the full vocabulary, i.e. the exact head; `eager` is the reference implementation) and τ is measured with
the engine; every output must equal plain greedy decoding. During the exact run, every draft step is also rolled
out with each pool on the same inputs: "prefix agreement at slot i" = the pool's drafts 0..i all equal the exact
head's (what acceptance depends on).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from domino_lab import Target, speculative_generate
from domino_lab.data.eval_sets import load_eval_set
from domino_lab.errors import CliParser, atomic_path, check_out_dir, run_cli
from domino_lab.models.domino_head import greedy_rollout
from domino_lab.models import InferenceOptions, load_drafter


def main(argv=None) -> int:
    p = CliParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="default")
    p.add_argument("--drafter", default="default")
    p.add_argument("--sets", nargs="+", default=["math", "humaneval"])
    p.add_argument("--pools", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    p.add_argument("--limit", type=int, default=48)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="experiments/results")
    a = p.parse_args(argv)
    check_out_dir(a.out)
    if a.quick:
        a.limit, a.max_new_tokens, a.pools = 2, 12, [16]
    torch.set_num_threads(1)
    target = Target.from_pretrained(a.target)
    drafter = load_drafter(a.drafter, target, options=InferenceOptions(head_impl="fast", candidate_pool=0))
    head = drafter.head
    n = drafter.config.num_drafts
    agree = {K: [0] * n for K in a.pools}
    steps = [0]
    exact_rollout = head.rollout

    def spy(h, base, anchor, embed_weight, n, base_top, pool=0, *rest, **kw):
        out = exact_rollout(h, base, anchor, embed_weight, n, base_top, pool, *rest, **kw)
        table, w_s, w1_h = head.fast_weights(embed_weight)
        for K in a.pools:
            toks = greedy_rollout(table, w_s, w1_h, head.w2.weight, h, base, anchor, K)[0]
            same = (toks == out.tokens).long().cumprod(-1).sum(0)        # rows whose prefix 0..i matches
            for i in range(toks.shape[1]):
                agree[K][i] += int(same[i])
        steps[0] += out.tokens.shape[0]
        return out

    rows = {}
    started = time.time()
    for s in a.sets:
        prompts = [r["prompt"] for r in load_eval_set(s, limit=a.limit)]
        plain = [speculative_generate(target, None, prompt=q, max_new_tokens=a.max_new_tokens).token_ids for q in prompts]
        for name, impl, K in [("eager", "eager", 0), ("fast K=0", "fast", 0)] + [(f"fast K={K}", "fast", K)
                                                                                  for K in a.pools]:
            drafter.set_head(impl, K)
            head.rollout = spy if name == "fast K=0" else exact_rollout
            taus, equal = [], 0
            for q, ref in zip(prompts, plain):
                res = speculative_generate(target, drafter, prompt=q, max_new_tokens=a.max_new_tokens)
                taus.append(res.mean_acceptance_length)
                equal += res.token_ids == ref
            rows.setdefault(s, {})[name] = {"tau": sum(taus) / len(taus), "lossless": f"{equal}/{len(prompts)}",
                                            "per_prompt_tau": taus}
            print(f"{s} {name}: τ {rows[s][name]['tau']:.4f}, lossless {equal}/{len(prompts)}", file=sys.stderr)
        head.rollout = exact_rollout
    agreement = {K: [c / steps[0] for c in agree[K]] for K in a.pools}
    cmd = "python experiments/head_pool.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [f"# Candidate pool of the fast Domino head: τ and draft agreement vs the exact head\n",
             f"`{cmd.strip()}` — {time.strftime('%Y-%m-%d')}, {a.limit} prompts per set, {a.max_new_tokens} new "
             f"tokens, greedy, shipped `{a.drafter}` drafter (vocabulary {drafter.config.vocab_size}); "
             f"{time.time() - started:.0f} s.\n",
             "| set | head | τ | τ vs exact | output equal to plain greedy |", "|---|---|---|---|---|"]
    for s, r in rows.items():
        ex = r["fast K=0"]["tau"]
        for name, v in r.items():
            lines.append(f"| {s} | {name} | {v['tau']:.4f} | {100 * (v['tau'] / ex - 1):+.2f}% | {v['lossless']} |")
    lines += ["", f"Prefix agreement with the exact head per draft slot ({steps[0]} draft steps of the exact runs):", "",
              "| K | " + " | ".join(f"slot {i}" for i in range(n)) + " |", "|---|" + "---|" * n]
    for K, v in agreement.items():
        lines.append(f"| {K} | " + " | ".join(f"{x:.4f}" for x in v) + " |")
    out = Path(a.out)
    with atomic_path(out / "head_pool.md") as t:
        t.write_text("\n".join(lines) + "\n")
    with atomic_path(out / "head_pool.json") as t:
        t.write_text(json.dumps({"command": cmd, "tau": rows, "agreement": agreement, "draft_steps": steps[0]},
                                indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    run_cli(main)
