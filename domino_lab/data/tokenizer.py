"""Byte-level BPE tokenizer of the embedded default target (docs/design.md#embedded-default).

- Byte-level: every byte string round-trips exactly (no normaliser, no added prefix space, and
  `clean_up_tokenization_spaces=False` so decode never "tidies" spaces before punctuation in code).
- Digits are split one per token before BPE: the tiny target must do the `<<a*b=c>>` arithmetic of
  the math domain, which is far easier digit by digit than with arbitrary merged number chunks.
- `<|endoftext|>` is EOS and pad (there is no BOS); `<|mask|>` is reserved for the drafter's MASK
  and never occurs in training data.
Saved as a `transformers.PreTrainedTokenizerFast`, so `AutoTokenizer.from_pretrained(dir)` loads it.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = [EOS_TOKEN, MASK_TOKEN]  # ids 0 and 1
DEFAULT_VOCAB_SIZE = 8192
MODEL_MAX_LENGTH = 2048


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE,
                    length: int | None = None) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        # all 256 byte symbols are in the vocab from the start, so nothing is ever unknown
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    return wrap(tok)


def wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        mask_token=MASK_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=MODEL_MAX_LENGTH,
    )


TOKENIZER_VERSION = "1"  # bump when the tokenizer pipeline above changes: it keys the cache


def training_texts(cache_dir=None, math_n: int = 40_000, code_files: int | None = None) -> Iterator[str]:
    """Code train split (optionally only its first `code_files` files) + a math sample. Math is
    formulaic, so a sample teaches its merges; all of it would crowd code merges out of the vocab."""
    from domino_lab.data.corpora import load_code_corpus, load_math_corpus

    code = load_code_corpus("train", cache_dir=cache_dir)
    if code_files is not None:
        code = code.select(range(min(code_files, len(code))))
    yield from code["text"]
    yield from load_math_corpus("train", n=math_n, cache_dir=cache_dir)["text"]


def load_or_train_tokenizer(cache_dir=None, vocab_size: int = DEFAULT_VOCAB_SIZE, math_n: int = 40_000,
                            code_files: int | None = None) -> PreTrainedTokenizerFast:
    """The tokenizer trained on the default corpora, cached under the cache dir by a fingerprint of
    its inputs (corpus keys, vocab size, pipeline version): trained once, then loaded."""
    from transformers import AutoTokenizer

    from domino_lab.data.cache import cache_root, fingerprint
    from domino_lab.data.corpora import code_corpus_key, math_corpus_key

    key = fingerprint(version=TOKENIZER_VERSION, vocab=vocab_size, code=code_corpus_key("train"),
                      code_files=code_files, math=math_corpus_key("train", math_n))
    root = cache_root(cache_dir)
    final = root / f"tokenizer-{key}"
    if not (final / "tokenizer.json").exists():
        tok = train_tokenizer(training_texts(cache_dir, math_n, code_files), vocab_size=vocab_size)
        tmp = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=root))
        try:
            tok.save_pretrained(str(tmp))
            try:
                os.replace(tmp, final)
            except OSError:
                if not (final / "tokenizer.json").exists():  # lost a race to an equal build: fine
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return AutoTokenizer.from_pretrained(str(final))
