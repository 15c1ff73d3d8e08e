"""The Python API's decoders and options refuse a value of the wrong type with one UserError that names it, before
any decoding (not a TypeError from deep inside a forward, and not a silent run: `max_new_tokens=inf` used to decode
to the end of the context)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from domino_lab import Target, speculative_generate
from domino_lab.decoding.batched import batched_generate
from domino_lab.errors import UserError
from domino_lab.models import Drafter, InferenceOptions


@pytest.fixture(scope="module")
def target():
    return Target.from_pretrained("default")


@pytest.mark.parametrize("kw, match", [
    ({"candidate_pool": 2.5}, "candidate pool must be a whole number"),
    ({"lookup": None}, "lookup must be a whole number"),
    ({"lookup": True}, "lookup must be a whole number"),
    ({"block_size": "4"}, "block size must be a whole number"),
    ({"draft_cutoff": "0.5"}, "draft cutoff must be a number"),
    ({"tree_min_prob": None}, "tree min prob must be a number"),
    ({"full_vocab": "no"}, "full vocab must be true or false"),        # a non-empty string would switch it on
    ({"adaptive_drafts": 1}, "adaptive drafts must be true or false"),
    ({"lookup": 17}, "lookup must be from 0 to 16"),                    # no suffix match is that long: never copies
])
def test_inference_options_check_their_types(kw, match):
    with pytest.raises(UserError, match=match):
        InferenceOptions(**kw)


@pytest.mark.parametrize("kw, match", [
    ({"prompt_ids": 5}, "the prompt must be a list of token ids, got int"),
    ({"prompt": [5, 6]}, "the prompt must be text"),
    ({"prompt": "a", "max_new_tokens": 2.5}, "max_new_tokens must be a whole number >= 1, got 2.5"),
    ({"prompt": "a", "max_new_tokens": math.inf}, "max_new_tokens must be a whole number >= 1, got inf"),
    ({"prompt": "a", "max_new_tokens": None}, "max_new_tokens must be a whole number"),
    ({"prompt": "a", "temperature": "0"}, "temperature must be a finite number"),
    ({"prompt": "a", "topk": 2.5}, "topk must be a whole number >= 0"),
    ({"prompt": "a", "block_size": "4"}, "block_size must be a whole number >= 1"),
    ({"prompt": "a", "tree_nodes": True}, "tree_nodes must be a whole number"),
])
def test_speculative_generate_checks_its_arguments(target, kw, match):
    with pytest.raises(UserError, match=match):
        speculative_generate(target, Drafter.untrained(target, "domino", block_size=4), **kw)


def test_a_drafter_name_is_not_a_drafter(target):
    with pytest.raises(UserError, match="drafter must be a loaded drafter .*load_drafter.*got str 'default'"):
        speculative_generate(target, "default", prompt="a")
    with pytest.raises(UserError, match="drafter must be a loaded drafter"):
        batched_generate(target, "default", [[5, 6]])


def test_batched_generate_checks_its_prompts_and_length(target):
    with pytest.raises(UserError, match="one list of token ids per prompt"):
        batched_generate(target, None, [5, 6])
    with pytest.raises(UserError, match="max_new_tokens must be a whole number >= 1, got 2.5"):
        batched_generate(target, None, [[5, 6]], max_new_tokens=2.5)


def test_numpy_numbers_and_tensors_are_taken(target):
    """What the checks must not refuse: numpy integers and floats, and a 2D tensor of prompts."""
    a = speculative_generate(target, None, prompt="def f(x):", max_new_tokens=np.int64(4), temperature=np.float32(0))
    b = speculative_generate(target, None, prompt="def f(x):", max_new_tokens=4)
    assert a.token_ids == b.token_ids and len(b.token_ids) == 4
    c = speculative_generate(target, None, prompt="def f(x):", max_new_tokens=4, seed=np.int64(3))
    assert c.token_ids == b.token_ids
    ids = target.encode("def f(x):")
    res = batched_generate(target, None, torch.tensor([ids, ids]), max_new_tokens=4)
    assert res.token_ids == [b.token_ids, b.token_ids]
    d = Drafter.untrained(target, "domino", block_size=4)
    res = batched_generate(target, d, (p for p in [ids, ids]), max_new_tokens=np.int64(4), drafts=np.int64(2),
                           slots=np.int64(1))                          # a generator of prompts is read once
    assert res.token_ids == [b.token_ids, b.token_ids]
