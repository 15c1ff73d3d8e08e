"""Byte-level BPE tokenizer of the embedded default target."""
from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from domino_lab.data import tokenizer as tokmod
from domino_lab.data.corpora import load_code_corpus, load_math_corpus
from domino_lab.data.packing import token_stream
from domino_lab.data.tokenizer import EOS_TOKEN, MASK_TOKEN, load_or_train_tokenizer

EDGE_CASES = [
    "", " ", "  two leading spaces", "trailing spaces   ", "\ttab\tindented\n\t\tcode", "windows\r\nline end",
    "unicode: é ñ 漢字 🙂 \u00a0nbsp", "x = a  +  b , c ;  d . e", "   \n\n   \n", "#### 1234567890",
    "def f():\n    return {'a': [1, 2]}  # comment\n", "<<12*3=36>>36 apples.", "a<|endoftext|>", "naïve café",
]


@pytest.fixture(scope="module")
def small_tok(tmp_path_factory):
    """A small tokenizer trained on a subset (the real one trains on all of it; same code path)."""
    cache = tmp_path_factory.mktemp("tokcache")
    tok = load_or_train_tokenizer(cache, vocab_size=1024, math_n=300, code_files=40)
    out = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out), cache


def test_special_tokens_are_single_reserved_ids(small_tok):
    tok, _ = small_tok
    eos, mask = tok.convert_tokens_to_ids(EOS_TOKEN), tok.convert_tokens_to_ids(MASK_TOKEN)
    assert eos != mask and eos is not None and mask is not None
    assert tok.eos_token_id == eos and tok.pad_token_id == eos and tok.mask_token_id == mask
    assert tok.encode(MASK_TOKEN, add_special_tokens=False) == [mask]
    assert tok.encode(EOS_TOKEN, add_special_tokens=False) == [eos]
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)  # no BOS
    assert len(tok) == 1024


def test_round_trip_on_code_and_math(small_tok):
    tok, cache = small_tok
    code = list(load_code_corpus("heldout", cache_dir=cache)["text"])
    math = list(load_math_corpus("heldout", n=200, cache_dir=cache)["text"])
    for text in code + math + EDGE_CASES:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text


def test_digits_are_split(small_tok):
    tok, _ = small_tok
    pieces = tok.tokenize("total 4096")
    assert [p for p in pieces if p.strip("Ġ").isdigit()] == ["4", "0", "9", "6"]


def test_tokenizer_is_cached(small_tok, monkeypatch):
    _, cache = small_tok

    def boom(*a, **k):
        raise AssertionError("retrained although its inputs did not change")

    monkeypatch.setattr(tokmod, "train_tokenizer", boom)
    tok = load_or_train_tokenizer(cache, vocab_size=1024, math_n=300, code_files=40)
    assert len(tok) == 1024


def test_training_stream_never_contains_mask(small_tok):
    tok, _ = small_tok
    mask = tok.convert_tokens_to_ids(MASK_TOKEN)
    eos = tok.convert_tokens_to_ids(EOS_TOKEN)
    stream = token_stream(tok, ["x = 1", f"leaked {MASK_TOKEN} literal", "y = 2"], "test")
    assert mask not in stream
    # documents are separated (and ended) by exactly one EOS; the leaking doc was dropped
    assert int(np.sum(stream == eos)) == 2 and stream[-1] == eos
    assert tok.decode(stream.tolist()) == f"x = 1{EOS_TOKEN}y = 2{EOS_TOKEN}"
