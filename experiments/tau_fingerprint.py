"""Greedy τ of the shipped drafters on fixed eval subsets, with a digest of every generated token and acceptance
length: run it before and after a refactor that must not change behaviour, and compare the two JSON files.

    python experiments/tau_fingerprint.py --out before.json      # then again after the change, and diff
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys

import torch

from domino_lab.data.eval_sets import load_eval_set
from domino_lab.decoding import speculative_generate
from domino_lab.errors import CliParser, atomic_path, check_out_file, run_cli
from domino_lab.models import load_drafter
from domino_lab.target import Target


def main(argv=None) -> int:
    p = CliParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafters", nargs="+", default=["default", "default-dflash"])
    p.add_argument("--sets", nargs="+", default=["math", "humaneval", "code"])
    p.add_argument("--limit", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    check_out_file(a.out)
    torch.set_num_threads(1)
    target = Target.from_pretrained("default")
    out = {}
    for name in a.drafters:
        d = load_drafter(name, target)
        for s in a.sets:
            steps = committed = 0
            h = hashlib.sha256()
            for row in load_eval_set(s, limit=a.limit):
                r = speculative_generate(target, d, prompt=row["prompt"], max_new_tokens=a.max_new_tokens, seed=0)
                steps += len(r.steps)
                committed += sum(r.acceptance_lengths)
                h.update(json.dumps([r.token_ids, r.acceptance_lengths]).encode())
            out[f"{name}/{s}"] = {"tau": repr(committed / steps), "steps": steps, "digest": h.hexdigest()[:16]}
            print(name, s, out[f"{name}/{s}"], file=sys.stderr, flush=True)
    with atomic_path(a.out) as t:
        t.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    run_cli(main)
