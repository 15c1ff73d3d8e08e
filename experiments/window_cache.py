"""A sliding-window target's K/V cache: window layers against full layers (every position, the window left to the
attention mask), decoding the same long continuations both ways in alternating rounds, plainly and with a drafter.
In a batch-1 chain the window layer keeps the window plus the last verify's tokens; in a batch (`--batch B`
prompts at once) it drops the columns no row's window reaches any more. Outputs must be identical; reported are the
target cache's bytes (a chain's at the end of the decode, a batch's largest after any step) and tokens/s (median
over rounds).

The target is a Mistral-shaped model with random weights (the shape is what matters for memory and time; its text is
meaningless), the drafter an untrained Domino drafter (its drafts are mostly rejected, so the cache is cut back
nearly every step, the case the window layer must survive).

    python experiments/window_cache.py --out experiments/results/window_cache
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from transformers import MistralConfig, MistralForCausalLM

from domino_lab import Drafter, Target, speculative_generate
from domino_lab.decoding import batched, engine, kv_cache
from domino_lab.errors import CliParser, UserError, atomic_path, check_out_dir, run_cli
from domino_lab.target import cpu_line


def build_target(window: int, layers: int, hidden: int) -> Target:
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=8192, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128), head_dim=64,
                        max_position_embeddings=16384, sliding_window=window, eos_token_id=None,
                        tie_word_embeddings=True)
    return Target(MistralForCausalLM(cfg).eval(), None, mask_token_id=8191, taps=[1, layers // 2, layers - 2])


def cache_bytes(cache) -> int:
    """Bytes the target cache's layers hold: their buffers (the growing and window layers) or their tensors."""
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "_k", None), getattr(layer, "_v", None)) if getattr(layer, "_k", None) is not None \
                else (layer.keys, layer.values):
            total += t.numel() * t.element_size()
    return total


def decode(target, drafter, prompt, new_tokens, bounded: bool):
    """(token ids, tokens/s, target cache bytes at the end) of one chain decode, its sliding layers bounded or full."""
    made = []

    def spy(config=None, capacity=None, bounded_windows=False):
        # the engine asks for bounded windows in a chain; `bounded` overrides that to measure the full layer
        made.append(kv_cache.new_cache(config, capacity, bounded_windows=bounded_windows and bounded))
        return made[-1]

    saved, engine.new_cache = engine.new_cache, spy
    try:
        res = speculative_generate(target, drafter, prompt_ids=prompt, max_new_tokens=new_tokens)
    finally:
        engine.new_cache = saved
    return res.token_ids, len(res.token_ids) / res.wall_time_s, cache_bytes(made[0])


def decode_batch(target, drafter, prompts, new_tokens, bounded: bool):
    """(token ids per prompt, tokens/s, the target cache's largest size after a step) of one batched decode, its
    sliding layers dropping what no row's window reaches (`bounded`) or full."""
    peak = [0]

    def spy_cache(config=None, capacity=None, bounded_windows=False, batch_windows=False):
        return kv_cache.new_cache(config, capacity, bounded_windows, batch_windows=batch_windows and bounded)

    def spy_drop(cache, valid, next_pos, least=None):
        kv_cache.drop_outside_windows(cache, valid, next_pos, least)
        peak[0] = max(peak[0], cache_bytes(cache))

    saved = batched.new_cache, batched.drop_outside_windows
    batched.new_cache, batched.drop_outside_windows = spy_cache, spy_drop
    try:
        res = batched.batched_generate(target, drafter, prompts, max_new_tokens=new_tokens, drafts="all")
    finally:
        batched.new_cache, batched.drop_outside_windows = saved
    return res.token_ids, sum(map(len, res.token_ids)) / res.wall_time_s, peak[0]


def main(argv=None) -> int:
    p = CliParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch", type=int, default=0, help="also decode this many prompts as one batch (0: chains only)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="folder for window_cache.md / .json (default: print only)")
    a = p.parse_args(argv)
    if min(a.window, a.layers, a.prompt_tokens, a.rounds, a.threads, *a.new_tokens) < 1 or a.hidden % 128 \
            or a.batch < 0:
        raise UserError("--window, --layers, --prompt-tokens, --new-tokens, --rounds and --threads must be ≥ 1, "
                        "--batch ≥ 0 and --hidden a multiple of 128")
    if a.out is not None:
        check_out_dir(a.out)
    torch.set_num_threads(a.threads)
    target = build_target(a.window, a.layers, a.hidden)
    drafter = Drafter.untrained(target, "domino", block_size=8)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 8000, (a.prompt_tokens,), generator=gen).tolist()
    # a batch's prompts differ in length (from half the prompt length to all of it), so its rows are not aligned
    prompts = [torch.randint(0, 8000, (a.prompt_tokens - i * a.prompt_tokens // (2 * a.batch),), generator=gen).tolist()
               for i in range(a.batch)]
    rows = []
    for decoding in ["chain"] + ["batch"] * (a.batch > 0):
        for new in a.new_tokens:
            for name, d in (("plain", None), ("domino (untrained)", drafter)):
                tps = {True: [], False: []}
                size = {}
                outs = {}
                for r in range(a.rounds):
                    for bounded in ((True, False) if r % 2 == 0 else (False, True)):
                        ids, rate, nbytes = decode(target, d, prompt, new, bounded) if decoding == "chain" else \
                            decode_batch(target, d, prompts, new, bounded)
                        tps[bounded].append(rate)
                        size[bounded] = nbytes
                        outs.setdefault(bounded, ids)
                        if ids != outs[bounded] or (True in outs and False in outs and outs[True] != outs[False]):
                            raise SystemExit(f"outputs differ ({name}, {new} tokens): the window layer is not exact")
                rows.append(dict(decoding="one sequence" if decoding == "chain" else f"batch of {a.batch}",
                                 method=name, new_tokens=new, context=a.prompt_tokens + new,
                                 window_mib=size[True] / 2**20, full_mib=size[False] / 2**20,
                                 window_tps=statistics.median(tps[True]), full_tps=statistics.median(tps[False])))
                print(rows[-1], flush=True)
    lines = [
        "# Sliding-window cache: window layers vs full layers, one sequence and a batch",
        "",
        f"`python experiments/window_cache.py {' '.join(argv if argv is not None else sys.argv[1:])}` — "
        f"{cpu_line()}, {torch.get_num_threads()} torch thread(s), "
        f"torch {torch.__version__}.",
        "",
        f"Target: Mistral-shaped, random weights, {a.layers} layers, hidden {a.hidden}, window {a.window}, float32; "
        f"prompt {a.prompt_tokens} random tokens" + (f" (a batch's: {len(prompts[-1])} to {a.prompt_tokens})"
                                                     if a.batch else "") +
        f"; {a.rounds} alternating rounds. Outputs identical both ways (checked every round). Cache: a chain's at the "
        "end of the decode, a batch's largest after any step (its rows leave as they finish); context: the longest "
        "row's.",
        "",
        "| decoding | drafter | new tokens | context | cache MiB, window layers | cache MiB, full layers | "
        "tokens/s window | tokens/s full | window ÷ full tokens/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['decoding']} | {r['method']} | {r['new_tokens']} | {r['context']} | "
                     f"{r['window_mib']:.2f} | {r['full_mib']:.2f} | {r['window_tps']:.1f} | {r['full_tps']:.1f} | "
                     f"{r['window_tps'] / r['full_tps']:.2f}× |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        out = Path(a.out)
        with atomic_path(out / "window_cache.md") as tmp:
            tmp.write_text(text)
        with atomic_path(out / "window_cache.json") as tmp:
            tmp.write_text(json.dumps(dict(args=vars(a), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    run_cli(main)
