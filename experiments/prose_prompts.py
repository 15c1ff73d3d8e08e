"""Prose-like prompts derived from the training split of the stdlib corpus (the openings of its comments and
docstrings, `domino_lab/data/prose.py`) as a JSONL file, for `regenerate --prompts`.

    python experiments/prose_prompts.py --n 1300 --out runs/prose/prose-1300.jsonl
    python -m domino_lab.regenerate --target default --prompts runs/prose/prose-1300.jsonl --out DIR ...

`regenerate --n-prose N` builds the same prompts itself; this file is how the prose-data experiment
(`experiments/results/prose_data.md`) made its data, kept so that its commands run as written.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from domino_lab.data.prose import prose_prompts  # noqa: E402
from domino_lab.errors import CliParser, UserError, atomic_path, check_out_file, run_cli  # noqa: E402


def main(argv=None) -> int:
    p = CliParser(prog="python experiments/prose_prompts.py", description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1300, help="prompts to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="JSONL file of {id, prompt, kind, source}")
    args = p.parse_args(argv)
    if args.n < 1:
        raise UserError(f"--n must be >= 1, got {args.n}")
    check_out_file(args.out, "--out")
    rows = prose_prompts("train", args.n, args.seed)
    with atomic_path(args.out) as tmp:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} prompts to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_cli(main)
