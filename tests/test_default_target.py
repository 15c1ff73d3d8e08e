"""The embedded default target ships in the package and works offline end to end."""
import json
import subprocess
import sys

import pytest

from domino_lab import Drafter, Target, speculative_generate
from domino_lab.data.eval_sets import load_eval_set


@pytest.fixture(scope="module")
def target():
    return Target.from_pretrained("default")


def test_default_target_loads_with_reserved_tokens(target):
    tok = target.tokenizer
    assert target.vocab_size == len(tok)
    assert target.mask_token_id == tok.convert_tokens_to_ids("<|mask|>")
    assert tok.convert_tokens_to_ids("<|endoftext|>") in target.eos_token_ids
    assert target.max_length == 512                     # the window it was trained on
    assert target.taps and max(target.taps) < target.num_layers


def test_generate_cli_on_a_humaneval_prompt():
    prompt = load_eval_set("humaneval", limit=1)[0]["prompt"]
    p = subprocess.run([sys.executable, "-m", "domino_lab.generate", "--target", "default", "--drafter", "none",
                        "--prompt", prompt, "--max-new-tokens", "24", "--json"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-1500:]
    d = json.loads(p.stdout)
    assert len(d["token_ids"]) > 0 and d["target_forward_calls"] == len(d["token_ids"]) or d["stop_reason"] == "eos"


def test_speculative_equals_plain_on_default(target):
    d = Drafter.untrained(target, "domino", block_size=4)
    for row in load_eval_set("math", limit=3):
        plain = speculative_generate(target, None, prompt=row["prompt"], max_new_tokens=24)
        spec = speculative_generate(target, d, prompt=row["prompt"], max_new_tokens=24)
        assert spec.token_ids == plain.token_ids


@pytest.mark.parametrize("name", ["default", "default-dflash", "default-nocopy", "default-dflash-nocopy"])
def test_shipped_drafters_are_lossless_and_accept(target, name):
    """The shipped drafters load by name, stay lossless on the default target, and actually get drafts accepted."""
    from domino_lab.models import load_drafter

    d = load_drafter(name, target)
    assert d.config.method == ("dflash" if "dflash" in name else "domino")
    assert bool(d.config.copy_ngram) != name.endswith("-nocopy")       # the shipped block drafters copy
    taus = []
    for row in load_eval_set("math", limit=3) + load_eval_set("humaneval", limit=2):
        plain = speculative_generate(target, None, prompt=row["prompt"], max_new_tokens=32)
        spec = speculative_generate(target, d, prompt=row["prompt"], max_new_tokens=32)
        assert spec.token_ids == plain.token_ids, row["id"]
        taus.append(spec.mean_acceptance_length)
    assert sum(taus) / len(taus) > 1.2          # an untrained drafter stays near 1.0


def test_shipped_assistant_shares_the_target_vocabulary(target):
    """`default-assistant` (hf-assisted in the bench) loads, matches the vocabulary and drafts real tokens."""
    import torch
    from domino_lab.bench import load_assistant
    m = load_assistant("default-assistant", target, None)
    ids = torch.tensor([target.encode("def add(a, b):")])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=m, do_sample=False,
                                max_new_tokens=12, pad_token_id=0)
    plain = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                                  pad_token_id=0)
    assert out.tolist() == plain.tolist()


def test_decode_threads_small_target_uses_one_thread(target):
    """A small CPU target decodes on one intra-op thread unless asked otherwise (docs/design.md#threads-...)."""
    import torch

    from domino_lab.errors import UserError
    from domino_lab.target import SMALL_TARGET_PARAMS, decode_threads

    assert sum(p.numel() for p in target.model.parameters()) < SMALL_TARGET_PARAMS
    assert decode_threads(target) == 1
    assert decode_threads(target, 3) == 3
    with pytest.raises(UserError, match="--threads"):
        decode_threads(target, 0)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        from domino_lab.generate import main
        assert main(["--prompt", "def add(a, b):", "--max-new-tokens", "4", "--drafter", "none"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
