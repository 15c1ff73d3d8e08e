"""Command-line flags that several decoding CLIs share (generate, bench, inference and the experiment scripts).

This module imports nothing heavy, so a CLI can build its parser, answer `--help` and reject a bad flag before torch,
transformers or Lightning load (several seconds each)."""
from __future__ import annotations

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


def add_threads_arg(p) -> None:
    """--threads for a CLI that decodes (pass its value to `target.use_decode_threads`)."""
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: for a target under 50M parameters on a CPU, 1, and for "
                        "batched decoding 1 or all cores, whichever measures faster; else all cores; "
                        "docs/design.md#threads-for-small-targets)")
