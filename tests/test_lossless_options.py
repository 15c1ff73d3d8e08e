"""Losslessness across combinations of inference options, on the shipped drafters and awkward prompts.

Each option has its own tests; this file draws combinations of them (head path, candidate pool, block cap, FR-Spec
off, draft cutoff, lookup drafting, adaptive drafts, tree verification with and without a probability floor), a
fixed-seed sample so that a failure reproduces, and checks every output against plain greedy decoding. The prompts
are the kind no eval set has: non-ASCII text, whitespace only, one character, a repeated pattern, and a prompt that
leaves the target's context only a few positions, so a step's drafts run into the end of the context."""
import random

import pytest

from domino_lab import speculative_generate
from domino_lab.models.drafter import load_drafter
from domino_lab.models.options import InferenceOptions
from domino_lab.target import Target

AWKWARD = [
    "😀🚀 ünïcödé 中文 текст: ",
    "\t\t\t\n\n",
    "x",
    "0 1 " * 60,
    "def parse(self, raw: bytes) -> dict:\n    \"\"\"Parse a header block; raise ValueError on a bad line.\"\"\"\n",
    "Tom has 17 apples and gives 5 to each of his 3 friends. How many apples are left?",
]


@pytest.fixture(scope="module")
def default_target():
    return Target.from_pretrained("default")


@pytest.fixture(scope="module")
def prompts(default_target):
    t = default_target
    ids = [t.encode(p) for p in AWKWARD]
    # a prompt 6 positions short of the context: the last steps' drafts reach past its end
    code = t.encode(AWKWARD[4]) * 200
    ids.append(code[: t.max_length - 6])
    return ids


def option_draws(n: int, seed: int):
    rng = random.Random(seed)
    for _ in range(n):
        tree = rng.choice([0, 0, 8, 32])
        opts = dict(head_impl=rng.choice(["fused", "fast", "eager"]), candidate_pool=rng.choice([64, 0, 8]),
                    block_size=rng.choice([None, 4, 2, 1]), full_vocab=rng.random() < 0.3,
                    draft_cutoff=rng.choice([0.0, 0.3]), lookup=rng.choice([0, 2]),
                    adaptive_drafts=not tree and rng.random() < 0.3,
                    tree_min_prob=rng.choice([0.0, 0.05]) if tree else 0.0)
        yield rng.choice(["default", "default-dflash"]), opts, tree, rng.choice([1, 9, 40])


def test_option_combinations_are_lossless(default_target, prompts):
    t = default_target
    plain = {}
    for k, (name, opts, tree, new) in enumerate(option_draws(40, seed=0)):
        ids = prompts[k % len(prompts)]
        key = (k % len(prompts), new)
        if key not in plain:
            plain[key] = speculative_generate(t, None, prompt_ids=ids, max_new_tokens=new).token_ids
        d = load_drafter(name, t, options=InferenceOptions(**opts))
        out = speculative_generate(t, d, prompt_ids=ids, max_new_tokens=new, tree_nodes=tree)
        assert out.token_ids == plain[key], (name, opts, tree, new, AWKWARD[k % len(prompts)][:30]
                                             if k % len(prompts) < len(AWKWARD) else "near the context end")


def test_gumbel_samples_equal_plain_sampling_across_options(default_target, prompts):
    """With the gumbel sampler the seed fixes the text: every drafter and option draw samples what plain decoding
    samples."""
    t = default_target
    for k, (name, opts, tree, new) in enumerate(option_draws(12, seed=1)):
        ids = prompts[k % len(prompts)]
        opts.update(head_impl="fused", candidate_pool=64)      # sampling scores the whole draft vocabulary anyway
        want = speculative_generate(t, None, prompt_ids=ids, max_new_tokens=new, temperature=0.8, seed=k,
                                    sampler="gumbel").token_ids
        d = load_drafter(name, t, options=InferenceOptions(**opts))
        got = speculative_generate(t, d, prompt_ids=ids, max_new_tokens=new, temperature=0.8, seed=k,
                                   sampler="gumbel", tree_nodes=tree).token_ids
        assert got == want, (name, opts, tree, new)
