"""Quality measurements of a target LM (used by `experiments/target_card.py`).

Greedy generation in left-padded batches, held-out loss over packed windows, final-answer parsing
for the math domain, "does it parse" for HumanEval completions, loop detection for degeneration,
and the latency of one greedy decode step with a KV cache.
"""
from __future__ import annotations

import ast
import re
import statistics
import time

import numpy as np
import torch

_ANSWER = re.compile(r"####\s*(-?[\d,]+)")


def final_answer(text: str) -> int | None:
    """The integer after the first `####` of a solution, or None when there is none."""
    m = _ANSWER.search(text)
    if not m:
        return None
    try:
        return int(m.group(1).replace(",", ""))
    except ValueError:
        return None


def is_looping(ids: list[int], min_len: int = 32, max_period: int = 20, min_match: float = 0.85) -> bool:
    """True when the second half of a continuation is (nearly) one short n-gram repeated: some period
    p <= max_period has tail[i] == tail[i - p] for at least `min_match` of the positions, i.e. the
    span covers most of the tail and repeats at least len(tail)/p times. Continuations shorter than
    `min_len` (the model stopped on its own) are not loops."""
    if len(ids) < min_len:
        return False
    tail = ids[len(ids) // 2:]
    arr = np.asarray(tail)
    for p in range(1, min(max_period, len(arr) // 2) + 1):
        if np.mean(arr[p:] == arr[:-p]) >= min_match:
            return True
    return False


def cut_at_function_end(completion: str) -> str:
    """Keep the completion up to the first non-blank line that starts at column 0 (the end of the
    top-level function the prompt opened), the usual HumanEval stop rule."""
    lines = completion.split("\n")
    for i, line in enumerate(lines[1:], start=1):
        if line.strip() and not line[0].isspace():
            return "\n".join(lines[:i])
    return completion


def parses(source: str) -> bool:
    try:
        ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    return True


@torch.no_grad()
def greedy_continuations(model, tokenizer, prompts: list[str], max_new_tokens: int,
                         batch_size: int = 16) -> list[list[int]]:
    """New token ids of each prompt's greedy continuation, cut before the first EOS.

    Prompts are sorted by length so each left-padded batch wastes little; results come back in the
    caller's order.
    """
    eos = tokenizer.eos_token_id
    enc = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(enc[i]))
    out: list[list[int] | None] = [None] * len(prompts)
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        width = max(len(enc[i]) for i in idx)
        ids = torch.full((len(idx), width), eos, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, width - len(enc[i]):] = torch.tensor(enc[i])
            mask[r, width - len(enc[i]):] = 1
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos)
        for r, i in enumerate(idx):
            new = gen[r, width:].tolist()
            out[i] = new[:new.index(eos)] if eos in new else new
    return out  # type: ignore[return-value]


@torch.no_grad()
def heldout_loss(model, stream: np.ndarray, seq_len: int, max_tokens: int | None = None,
                 batch_size: int = 8) -> tuple[float, int]:
    """Mean next-token loss (nats) over aligned windows of a packed stream, and the tokens scored."""
    n_win = len(stream) // seq_len
    if max_tokens is not None:
        n_win = min(n_win, max(1, max_tokens // seq_len))
    if n_win == 0:
        raise ValueError("held-out stream is shorter than one window")
    total, count = 0.0, 0
    for b in range(0, n_win, batch_size):
        w = np.stack([stream[i * seq_len:(i + 1) * seq_len] for i in range(b, min(n_win, b + batch_size))])
        x = torch.from_numpy(w.astype(np.int64))
        logits = model(input_ids=x).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                 reduction="sum")
        total += float(loss)
        count += x[:, 1:].numel()
    return total / count, count


@torch.no_grad()
def decode_step_ms(model, prompt_ids: list[int], steps: int = 64, warmup: int = 8) -> float:
    """Median wall time of one greedy decode step (batch 1, one new token, KV cache) after a prefill."""
    x = torch.tensor([prompt_ids])
    out = model(input_ids=x, use_cache=True)
    cache, nxt = out.cache, out.logits[:, -1:].argmax(-1)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        out = model(input_ids=nxt, cache=cache, use_cache=True)
        cache, nxt = out.cache, out.logits[:, -1:].argmax(-1)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)
