"""Command-line flags that several decoding CLIs share (generate, bench, inference and the experiment scripts).

This module imports nothing heavy, so a CLI can build its parser, answer `--help` and reject a bad flag before torch,
transformers or Lightning load (several seconds each)."""
from __future__ import annotations

from .errors import UserError

# How a sampled decode (T > 0) verifies drafts: "rejection" = standard speculative sampling (the drafter samples,
# the target accepts with probability min(1, p/q)); "gumbel" = Gumbel-max coupling (`sampling.GumbelNoise`): the
# target's token at every position is argmax(log p + g) with noise g fixed by the seed and the position, and the
# drafter proposes the same argmax over its own logits, so a draft is accepted when it equals that token.
SAMPLERS = ("rejection", "gumbel")


def add_sampler_arg(p) -> None:
    """`--sampler`, for the CLIs that sample."""
    p.add_argument("--sampler", choices=SAMPLERS, default="rejection",
                   help="how T > 0 verifies drafts: rejection (standard speculative sampling, the default) or gumbel "
                        "(Gumbel-max coupling: the seed fixes the text, the same with or without a drafter; "
                        "docs/design.md#gumbel-coupled-sampling)")


def check_greedy_flags(args) -> None:
    """--top-p and --sampler shape sampled decoding; at temperature 0 they would be ignored without a word, and a run
    records what its command line said (bench.json's top_p), so they are refused there."""
    if args.temperature == 0:
        given = [flag for flag, on in (("--top-p", getattr(args, "top_p", 1.0) != 1.0),
                                       ("--sampler", args.sampler != "rejection")) if on]
        if given:
            raise UserError(f"{given[0]} shapes sampling at T > 0, and this run is greedy: add --temperature T or "
                            f"drop {given[0]}")


def add_threads_arg(p) -> None:
    """--threads for a CLI that decodes (pass its value to `target.use_decode_threads`)."""
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: for a target under 50M parameters on a CPU, 1, and for "
                        "batched decoding 1 or all cores, whichever measures faster; else all cores; "
                        "docs/design.md#threads-for-small-targets)")
