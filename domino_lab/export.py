"""`python -m domino_lab.export`: write a drafter in the layout of the public Domino / DFlash releases.

`--format domino` (Domino release: SGLang's Domino branch, its Transformers code, SpecForge), `dflash` (DFlash
release: SGLang / vLLM `dflash`; shift_label=False drafters only) or `speculators` (vLLM's speculators format).
The out directory gets config.json, model.safetensors and a README.md with the serving commands; it is written
atomically. Exported directories load back here anywhere a drafter directory is accepted (`--drafter DIR`).
Layouts and name mapping: domino_lab/models/export.py.
"""
from __future__ import annotations

import argparse

from .errors import CliParser, UserError, check_out_dir, run_cli

FORMATS = ("domino", "dflash", "speculators")
DTYPES = ("float32", "bfloat16", "float16")


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(prog="python -m domino_lab.export", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", required=True,
                   help="shipped name (default-nocopy, default-dflash-nocopy: the release layouts have no copy "
                        "input) or a drafter directory")
    p.add_argument("--format", required=True, choices=FORMATS, help="the release layout to write")
    p.add_argument("--out", required=True, help="directory to write (replaced if it holds an earlier export)")
    p.add_argument("--target", default="default",
                   help="the drafter's target: HF model id, local model dir, or 'default' (embedded)")
    p.add_argument("--dtype", default=None, choices=DTYPES, help="tensor dtype in the export (default: as trained)")
    p.add_argument("--verifier", default=None,
                   help="speculators only: the verifier's Hugging Face id to record (default: --target)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_out_dir(args.out)            # empty, a file, not writable: before any model loads
    if args.verifier is not None and args.format != "speculators":
        raise UserError(f"--verifier is recorded by the speculators format only, and --format is {args.format}: drop "
                        "--verifier or use --format speculators")
    from .models.export import export_drafter, frspec_note
    from .models.drafter import load_drafter
    from .target import Target, parse_dtype

    target = Target.from_pretrained(args.target)
    drafter = load_drafter(args.drafter, target)
    if drafter is None:
        raise UserError("--drafter none has nothing to export; name a drafter (default-nocopy, "
                        "default-dflash-nocopy, a directory)")
    out = export_drafter(drafter, args.format, args.out, dtype=parse_dtype(args.dtype), verifier=args.verifier)
    c = drafter.config
    print(f"wrote {out} ({args.format} layout: config.json, model.safetensors, README.md) -- {c.method}, "
          f"block {c.block_size}, {c.num_drafts} drafts per block, taps {list(c.target_layer_ids)}")
    if c.frspec_k:
        print(f"note: {frspec_note(c)}")
    return 0


if __name__ == "__main__":
    run_cli(main)
