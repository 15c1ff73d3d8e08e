"""Micro-benchmark of one draft step: DFlash (head off) vs the Domino head, eager vs fast vs compiled vs fused,
across block sizes and vocabulary sizes (docs/design.md#head-inference-paths). One draft step = backbone + LM head
+ (for Domino) the sequential GRU rollout.

    python experiments/head_microbench.py                      # full grid -> experiments/results/head_microbench.md
    python experiments/head_microbench.py --quick --out /tmp/x # tests

The embedded vocabulary (8192) uses the shipped `default` drafter; larger vocabularies use random Qwen3 targets of
the same width with untrained drafters (timing does not depend on the weights). Times are medians over interleaved
repetitions of per-thread CPU time (`time.thread_time`, robust to other processes sharing the cores) and of wall
time; one torch thread.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from domino_lab import Drafter, Target
from domino_lab.errors import CliParser, atomic_path, check_out_dir, run_cli
from domino_lab.experiments.timing import cached_step, interleaved_ms
from domino_lab.models.drafter import load_drafter
from domino_lab.target import cpu_description

VARIANTS = ("dflash", "eager", "fast K=0", "fast K=64", "fast K=256", "compiled K=64", "fused K=0", "fused K=64")


def random_target(vocab: int, hidden: int = 256, seed: int = 0) -> Target:
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                      tie_word_embeddings=True)
    return Target(Qwen3ForCausalLM(cfg).eval(), None, mask_token_id=vocab - 1, taps=[1])


def drafter_for(vocab: int, block: int) -> Drafter:
    if vocab == 8192:
        d = load_drafter("default", Target.from_pretrained("default", dtype="float32"))
        d.config.block_size = block     # same weights; the block size only sets how many slots are drafted
        return d
    return Drafter.untrained(random_target(vocab), "domino", block_size=block, num_layers=1)


def set_variant(d: Drafter, v: str) -> None:
    d.head_enabled = v != "dflash"
    d.set_head(v.split()[0] if v != "dflash" else "fast", int(v.split("K=")[1]) if "K=" in v else 0)


def measure(d: Drafter, ctx: int, reps: int, rounds: int, variants=VARIANTS) -> dict:
    step = cached_step(d, ctx, torch.Generator().manual_seed(0))
    return interleaved_ms(step, variants, lambda v: set_variant(d, v), reps, rounds)


def profile_default(ctx: int, reps: int) -> dict:
    """Where one speculative step's time goes on the embedded default (block 8): draft components and verify."""
    from transformers import DynamicCache

    target = Target.from_pretrained("default", dtype="float32")
    d = load_drafter("default", target)
    cfg = d.config
    g = torch.Generator().manual_seed(0)
    step = cached_step(d, ctx, g)
    anchor = torch.tensor([17])
    h = torch.randn(1, cfg.num_drafts, cfg.hidden_size, generator=g)
    base = d.lm_head(h)
    base_top = base.topk(5, dim=-1)
    base_top = (base_top.indices, base_top.values)
    emb = target.embed_tokens.weight
    prompt = torch.randint(2, cfg.vocab_size - 1, (1, ctx), generator=g)
    cache = DynamicCache()
    with torch.no_grad():
        target.forward(prompt, cache=cache)

    def verify(k):
        with torch.no_grad():
            target.forward(prompt[:, :k], cache=cache, taps=cfg.target_layer_ids,
                           position_ids=torch.arange(ctx, ctx + k)[None])
        cache.crop(-k)     # drop the k verified positions again

    def draft(v):
        set_variant(d, v)
        step()

    parts = {
        "draft step, head off (backbone + LM head + top-k records)": lambda: draft("dflash"),
        "  of which LM head (8 slots x 8192)": lambda: d.lm_head(h),
        "Domino rollout, eager (nn.GRU + full W2)": lambda: draft("eager"),
        "Domino rollout, fast K=64": lambda: d.head.rollout(h, base, anchor, emb, base.shape[1], base_top, 64),
        "Domino rollout, compiled K=64": lambda: d.head.rollout(h, base, anchor, emb, base.shape[1], base_top, 64, impl="compiled"),
        "Domino rollout, fused K=64": lambda: d.head.rollout(h, base, anchor, emb, base.shape[1], base_top, 64, impl="fused"),
        "verify: target forward of 9 tokens": lambda: verify(cfg.num_drafts + 1),
        "plain decoding step: target forward of 1 token": lambda: verify(1),
    }
    out = {}
    for name, fn in parts.items():
        for _ in range(3):
            fn()
        ts = []
        for _ in range(reps):
            c0 = time.thread_time()
            fn()
            ts.append(time.thread_time() - c0)
        out[name] = 1e3 * statistics.median(ts)
    # the eager row timed a whole draft step: report its rollout as the difference to the head-off step
    out["Domino rollout, eager (nn.GRU + full W2)"] -= out["draft step, head off (backbone + LM head + top-k records)"]
    return out


def table(rows: list[dict]) -> str:
    variants = list(rows[0]["ms"])
    ratios = [v for v in ("eager", "fast K=0", "fast K=64", "compiled K=64", "fused K=0", "fused K=64")
              if v in variants]
    head = "| vocab | block | " + " | ".join(variants) + " | " + " | ".join(f"{v} / dflash" for v in ratios) + " |"
    lines = [head, "|" + "---|" * (len(variants) + len(ratios) + 2)]
    for r in rows:
        m = r["ms"]
        ratio = lambda v: f"{m[v]['cpu_ms'] / m['dflash']['cpu_ms']:.2f}x"
        lines.append(f"| {r['vocab']} | {r['block']} | " + " | ".join(f"{m[v]['cpu_ms']:.2f}" for v in variants) +
                     " | " + " | ".join(ratio(v) for v in ratios) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = CliParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocabs", type=int, nargs="+", default=[8192, 32768, 151936])
    p.add_argument("--blocks", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--ctx", type=int, default=128, help="context positions the draft attends to")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant")
    p.add_argument("--quick", action="store_true", help="one small case, few repetitions, no compile (tests)")
    p.add_argument("--out", default="experiments/results", help="folder for head_microbench.md/.json")
    a = p.parse_args(argv)
    check_out_dir(a.out)
    if a.quick:
        a.vocabs, a.blocks, a.reps, a.rounds, a.ctx, a.no_compile = [512], [4], 2, 1, 16, True
    variants = [v for v in VARIANTS if not (a.no_compile and v.startswith("compiled"))]
    torch.set_num_threads(1)
    rows = []
    for vocab in a.vocabs:
        for block in a.blocks:
            d = drafter_for(vocab, block)
            rows.append({"vocab": vocab, "block": block, "ms": measure(d, a.ctx, a.reps, a.rounds, variants)})
            print(f"vocab {vocab} block {block}: " + ", ".join(f"{v} {x['cpu_ms']:.2f}" for v, x in rows[-1]["ms"].items()),
                  file=sys.stderr)
    prof = profile_default(a.ctx, a.reps * a.rounds) if not a.quick else {}
    out = Path(a.out)
    cmd = "python experiments/head_microbench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    md = (f"# One draft step: DFlash vs Domino head (eager, fast, compiled, fused)\n\n`{cmd.strip()}` — "
          f"{time.strftime('%Y-%m-%d')}, "
          f"{cpu_description()}, torch {torch.__version__}, 1 thread, context {a.ctx}.\n\n"
          "Median CPU ms per draft step (thread CPU time; wall-clock medians in the JSON), decoding-like: the context "
          "is in the draft cache and 2 newly committed positions are appended. `dflash` is the same "
          "drafter with the head off; `fast K` scores the correction on a pool of K candidates (K=0: full "
          "vocabulary, the exact drafts); `compiled` is the fast greedy rollout under torch.compile (compiled "
          "during warm-up, not timed); `fused` is the greedy rollout as one C++ loop (head_impl=fused, the "
          "default; built during warm-up).\n\n" + table(rows) + "\n")
    if prof:
        md += ("\n## Where a speculative step's time goes (embedded default, block 8, context "
               f"{a.ctx}; median CPU ms)\n\n| part | ms |\n|---|---|\n" +
               "\n".join(f"| {k} | {v:.2f} |" for k, v in prof.items()) + "\n")
    with atomic_path(out / "head_microbench.md") as t:
        t.write_text(md)
    with atomic_path(out / "head_microbench.json") as t:
        t.write_text(json.dumps({"command": cmd, "ctx": a.ctx, "rows": rows, "profile_ms": prof}, indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    run_cli(main)
