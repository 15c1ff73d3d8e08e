"""How cheap can the shipped drafter's draft step get on this CPU? The draft step against its parts and its floor.

    python experiments/draft_floor.py                       # -> experiments/results/draft_floor/draft_floor.md
    python experiments/draft_floor.py --quick --no-compile --out /tmp/x      # tests

The goal of a draft step at most 0.35 of a plain target step asks whether the drafter's cost is overhead (small
tensor ops, each paying PyTorch's dispatch) or arithmetic (its weights' matmuls). On one context, in turn as a decode
meets them (each part after a target forward), this times:

- `plain step`: the target's one-token forward on a 128-token cache; `draft step`: the drafter's whole draft call
  (experiments.timing.cached_step: backbone, copy input, LM-head slice, head);
- `backbone`: the two draft layers alone (`Backbone.infer`, the cache's key and value buffers as plain tensors), in
  eager mode and (unless --no-compile) under torch.compile with static shapes, which fuses the small ops around the
  matmuls (decoding's `backbone_impl=compiled` compiles the pass up to the head, embeddings, copy input, backbone
  and LM-head slice, with dynamic shapes, whose guards cost a little more; `draft step (compiled backbone)`; on a
  CPU inductor writes that pass's wrapper in C++, and `draft step (compiled, Python wrapper)` is the same pass with
  its default Python wrapper);
- `matmuls`: only the backbone's linear layers, with its weights at its shapes, and `lm head`: the FR-Spec slice of
  the LM head over the drafted slots: what remains with no overhead at all; `matmuls, weights in cache`: the same
  matmuls run once more right before they are timed, so their weights come from the cache, not from memory;
- `copy input host work`: what a decoding step does on the host for a drafter with a copy input before it drafts
  (the copy index catching up with the committed tokens, the candidates as tensors), which `draft step` leaves out.

Medians of thread CPU time over interleaved rounds (one torch thread, as decoding runs this target).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from domino_lab import Target
from domino_lab.errors import CliParser, check_out_dir, run_cli
from domino_lab.experiments.results import write_results
from domino_lab.experiments.timing import cached_step
from domino_lab.models import compiled_pass
from domino_lab.models.drafter import load_drafter
from domino_lab.target import cpu_line


COPY_NEW = 7     # committed tokens a decoding step's copy index catches up with: about a math step's
HOT = "matmuls, weights in cache"     # the same matmuls timed right after themselves instead of after a target step


def backbone_call(d, ctx: int, new: int, g: torch.Generator):
    """`Backbone.infer` (the backbone's pass with the draft cache's key and value buffers as tensors) over `new`
    context positions and the block, `ctx - new` positions cached: returns make(compiled: bool) -> a no-argument
    callable."""
    cfg = d.config
    q = cfg.block_size
    emb = torch.randn(1, q, cfg.hidden_size, generator=g)
    feats = torch.randn(1, new, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g)
    pos = torch.arange(ctx - new, ctx + q)[None]
    # (each call writes the same `new` positions after the cached ones)
    kv = [(torch.randn(1, cfg.num_key_value_heads, ctx, cfg.head_dim, generator=g),
           torch.randn(1, cfg.num_key_value_heads, ctx, cfg.head_dim, generator=g)) for _ in d.backbone.layers]

    def make(compiled: bool):
        f = torch.compile(d.backbone.infer, dynamic=False) if compiled else d.backbone.infer
        return lambda: f(emb, feats, pos, kv, ctx - new)
    return make


def matmul_call(d, ctx: int, new: int, g: torch.Generator):
    """The backbone's linear layers alone, in its order, at its shapes (fc and K/V over context + block rows)."""
    bb, cfg = d.backbone, d.config
    rows = {id(bb.fc): new}
    for layer in bb.layers:
        a = layer.self_attn
        rows |= {id(a.k_proj): new + cfg.block_size, id(a.v_proj): new + cfg.block_size}
    lins = [m for m in bb.modules() if isinstance(m, torch.nn.Linear)]
    xs = [torch.randn(rows.get(id(m), cfg.block_size), m.in_features, generator=g) for m in lins]
    return lambda: [F.linear(x, m.weight) for x, m in zip(xs, lins)]


def copy_host_call(d, ctx: int, new: int, g: torch.Generator, calls: int):
    """The copy input's host work in one decoding step, which `draft step` leaves out (it computes its candidates
    once): the copy index catching up with `new` committed tokens, then the block's candidates as tensors. Each call
    takes its own copy of an index over `ctx` tokens, made ahead of the timing."""
    from domino_lab.decoding.lookup import copy_index, copy_inputs

    ids = torch.randint(0, d.config.vocab_size, (ctx + new,), generator=g).tolist()
    base = copy_index(d.config.copy_ngram, ids[:ctx])
    fresh = [copy.deepcopy(base) for _ in range(calls)]

    def step():
        ix = fresh.pop()
        ix.catch_up(ids[:ctx], ids[ctx:])
        copy_inputs([ix], d.config.num_drafts)
    return step


def lm_head_call(d, g: torch.Generator):
    h = torch.randn(1, d.config.num_drafts, d.config.hidden_size, generator=g)
    return lambda: d.draft_logits(h)


def measure(target, d, ctx: int, reps: int, rounds: int, compile_backbone: bool) -> dict:
    from domino_lab.decoding.kv_cache import new_cache

    g = torch.Generator().manual_seed(0)
    cache = new_cache(target.model.config)
    target.forward(torch.randint(0, target.vocab_size, (1, ctx), generator=g), cache=cache, last_logits_only=True)
    one = torch.randint(0, target.vocab_size, (1, 1), generator=g)

    def plain():
        target.forward(one, cache=cache, greedy=True)
        cache.crop(-1)

    backbone = backbone_call(d, ctx, 2, g)
    parts = {"plain step": plain, "draft step": cached_step(d, ctx, g, copy=True), "backbone (eager)": backbone(False)}
    if compile_backbone:
        from dataclasses import replace

        dc = copy.copy(d)           # the same weights, drafting through the compiled backbone as decoding would
        dc.options = replace(d.options, backbone_impl="compiled")
        parts["draft step (compiled backbone)"] = cached_step(dc, ctx, g, copy=True)
        if compiled_pass.CPP_WRAPPER:
            # the same pass compiled again with inductor's Python wrapper (compiled_pass.CPP_WRAPPER)
            dp = copy.copy(d)
            dp.options = dc.options
            compiled_pass.CPP_WRAPPER = False
            compiled_pass.clear()
            try:
                parts["draft step (compiled, Python wrapper)"] = cached_step(dp, ctx, g, copy=True)
            finally:
                compiled_pass.CPP_WRAPPER = True
        parts["backbone (compiled)"] = backbone(True)
    matmuls = matmul_call(d, ctx, 2, g)
    parts |= {"matmuls": matmuls, HOT: matmuls, "lm head": lm_head_call(d, g)}
    if d.config.copy_ngram:
        parts[f"copy input host work ({COPY_NEW} new tokens)"] = copy_host_call(d, ctx, COPY_NEW, g, rounds * reps + 1)
    times: dict = {name: [] for name in parts}
    with torch.no_grad():
        for f in parts.values():          # warm-up; compiles the compiled backbone
            f()
        for _ in range(rounds):
            for name, f in parts.items():
                for _ in range(reps):
                    plain()               # every part after a target forward, as in a decode
                    if name == HOT:
                        f()               # ... but this one: its weights back in the cache first
                    t0 = time.thread_time()
                    f()
                    times[name].append(time.thread_time() - t0)
    return {name: 1e3 * statistics.median(v) for name, v in times.items()}


def report(ms: dict, args, meta: dict) -> str:
    plain = ms["plain step"]
    lines = ["# The draft step and its floor", "",
             f"`python experiments/draft_floor.py{' --quick' if args.quick else ''}` — {meta['machine']}, "
             f"torch {meta['torch']}, 1 torch thread, {meta['date']}; drafter `{args.drafter}`, context {args.ctx}, "
             f"{args.rounds} rounds × {args.reps} calls per part, interleaved, medians of thread CPU time.", "",
             "| part | ms | ÷ plain step |", "|---|---|---|"]
    lines += [f"| {name} | {v:.3f} | {v / plain:.2f} |" for name, v in ms.items()]
    floor = ms["matmuls"] + ms["lm head"]
    lines += ["", f"Without any overhead a draft step would still cost the backbone's matmuls and the LM-head slice: "
              f"{floor:.3f} ms, {floor / plain:.2f} of a plain step (the head's rollout and the copy input come on "
              "top)."]
    if "backbone (compiled)" in ms:
        saved = ms["backbone (eager)"] - ms["backbone (compiled)"]
        lines += [f"torch.compile of the backbone with static shapes saves {saved:.3f} ms of its "
                  f"{ms['backbone (eager)']:.3f} ms; drafting through it as decoding does (`backbone_impl=compiled`, "
                  f"dynamic shapes) takes {ms['draft step (compiled backbone)']:.3f} ms, "
                  f"{ms['draft step (compiled backbone)'] / plain:.2f} of a plain step."]
    lines += [f"Timed right after themselves, with their weights in the cache, the matmuls take {ms[HOT]:.3f} ms against "
              f"{ms['matmuls']:.3f} after a target step. The difference, {ms['matmuls'] - ms[HOT]:.3f} ms, is the "
              "drafter's weights coming back into the cache: next to nothing where the processor's last-level cache "
              "holds both models, more where it cannot (docs/design.md#cpu-caches)."]
    host = next((k for k in ms if k.startswith("copy input host work")), None)
    if host:
        lines += [f"In decoding, each draft step also pays the copy input's host work, which `draft step` leaves out "
                  f"(the index catching up with {COPY_NEW} committed tokens, the candidates' tensors): "
                  f"{ms[host]:.3f} ms, {ms[host] / plain:.2f} of a plain step."]
    if "draft step (compiled, Python wrapper)" in ms:
        py = ms["draft step (compiled, Python wrapper)"]
        lines += [f"With inductor's Python wrapper instead of the C++ one the compiled step takes {py:.3f} ms: the C++ "
                  f"wrapper's step is {ms['draft step (compiled backbone)'] / py:.2f} of it."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = CliParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", default="default")
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-compile", action="store_true", help="leave out the compiled backbone (it compiles ~15 s)")
    p.add_argument("--quick", action="store_true", help="2 rounds of 3 calls (tests)")
    p.add_argument("--out", default="experiments/results/draft_floor")
    args = p.parse_args(argv)
    if args.quick:
        args.reps, args.rounds = 3, 2
    out = check_out_dir(args.out, "--out")
    torch.set_num_threads(1)
    target = Target.from_pretrained("default", dtype="float32")
    d = load_drafter(args.drafter, target)
    ms = measure(target, d, args.ctx, args.reps, args.rounds, not args.no_compile)
    meta = {"machine": f"{cpu_line()}, {torch.get_num_threads()} torch thread(s) of "
                       f"{__import__('os').cpu_count()} CPUs",
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    write_results(out, "draft_floor", {"ms": ms, "meta": meta, "argv": sys.argv[1:] if argv is None else argv},
                  report(ms, args, meta))
    return 0


if __name__ == "__main__":
    run_cli(main)
