"""What the speculative engine adds on top of the target's own forward, and what a draft step costs, on this CPU.

    python experiments/engine_overhead.py                 # -> experiments/results/engine_overhead.{md,json}
    python experiments/engine_overhead.py --quick --out /tmp/eo   (tests: 2 prompts, 12 tokens, untrained drafters)

Same process, same prompts, interleaved prompt by prompt, greedy, batch 1, embedded default target:

- **bare 1-token forward**: a Hugging Face forward of one token on a DynamicCache, argmax, next token: the floor of
  plain decoding, timed per step (median and mean). **engine plain step**: `speculative_generate(drafter=None)`,
  (wall − prefill) / steps: a mean, so its overhead is read against the bare loop's mean.
- **bare verify forward**: a Hugging Face forward of the anchor + 8 drafts on the cache (with the taps' hidden
  states, as verification needs them), then a crop. **engine verify**: the engine's verify time per step (forward,
  acceptance, cache crop) with the shipped Domino drafter.
- **draft step**: the engine's draft time per step for each shipped drafter, as a fraction of the engine plain step.

With `--omp-policies PASSIVE ACTIVE default` every measurement runs in fresh processes under each OpenMP wait
policy, alternating, so the thread policy is chosen by measurement rather than folklore.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from transformers import DynamicCache

from domino_lab.config import repo_root
from domino_lab.errors import CliParser, UserError, check_out_dir, run_cli
from domino_lab.experiments.results import write_results
from domino_lab.target import cpu_line

DRAFTERS = {"dflash": "default-dflash", "domino": "default", "eagle": "default-eagle"}


def bare_decode_ms(target, ids: list[int], n: int) -> tuple[float, float]:
    """(median, mean) ms per token of plain greedy decoding written directly against the HF model (no engine).
    The engine's plain step is a mean (wall time over steps), so the mean is what it is compared with: a median
    drops the occasional slow step (allocator, page faults) that a mean keeps."""
    model = target.model
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
        tok = out.logits[0, -1].argmax()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            out = model(input_ids=tok.view(1, 1), cache=cache, use_cache=True)
            tok = out.logits[0, -1].argmax()
            int(tok)                                  # the engine needs the token on the host too
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times), 1000 * statistics.fmean(times)


def bare_verify_ms(target, ids: list[int], taps: list[int], block: int, reps: int) -> float:
    """Median ms of one HF forward over `block` tokens on a cache holding the prompt (tapped hidden states on),
    cropped back after each call so every call sees the same state."""
    model = target.model
    cache = DynamicCache(config=model.config)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(4, target.vocab_size - 1, (1, block), generator=g)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            out = model(input_ids=x, cache=cache, use_cache=True, output_hidden_states=True)
            torch.cat([out.hidden_states[j + 1] for j in taps], dim=-1)
            out.logits.argmax(-1).tolist()
            times.append(time.perf_counter() - t0)
            cache.crop(-block)
    return 1000 * statistics.median(times)


def measure(args) -> dict:
    from domino_lab import Target
    from domino_lab.data.eval_sets import load_eval_set
    from domino_lab.decoding import speculative_generate
    from domino_lab.models import load_drafter

    torch.set_num_threads(args.threads)
    # the full LM head, as the bare loops read it: this measures what the engine adds around the same forward (the
    # half-precision head screen, which makes a greedy step cheaper than a bare forward: experiments/head_screen.py)
    target = Target.from_pretrained("default", dtype="float32", head_screen=False)
    drafters = {k: load_drafter(f"untrained:{k}" if args.quick else v, target)
                for k, v in DRAFTERS.items() if k in args.drafters}
    prompts = [p["prompt"] for s in args.sets for p in load_eval_set(s, limit=args.limit)]
    taps = drafters["domino"].config.target_layer_ids if "domino" in drafters else target.taps
    block = 1 + (drafters["domino"].config.num_drafts if "domino" in drafters else 8)
    rows = {k: [] for k in ["bare_step", "bare_step_mean", "engine_step", "bare_verify", "engine_verify",
                            *[f"draft_{d}" for d in drafters]]}
    rows["engine_step_paired"], rows["engine_verify_paired"] = [], []
    for i, prompt in enumerate([prompts[0]] + prompts):          # the first prompt again, as a warm-up
        ids = target.encode(prompt)
        reps = []
        # each measurement `repeats` times, the order reversed every other time, so that a slow spell of the
        # machine falls on the bare loop and the engine alike; the per-prompt medians are then paired
        for rep in range(args.repeats):
            r = {}

            def bare():
                r.update(zip(["bare_step", "bare_step_mean"], bare_decode_ms(target, ids, args.max_new_tokens)))
                r["bare_verify"] = bare_verify_ms(target, ids, taps, block, args.max_new_tokens)

            def engine():
                res = speculative_generate(target, None, prompt_ids=ids, max_new_tokens=args.max_new_tokens + 1)
                r["engine_step"] = 1000 * (res.wall_time_s - res.prefill_time_s) / max(1, len(res.steps))
                for name, d in drafters.items():
                    res = speculative_generate(target, d, prompt_ids=ids, max_new_tokens=args.max_new_tokens)
                    steps = [s for s in res.steps if s.draft_tokens]
                    r[f"draft_{name}"] = 1000 * statistics.median(s.draft_time_s for s in steps)
                    if name == "domino":
                        r["engine_verify"] = 1000 * statistics.median(
                            s.verify_time_s for s in steps if len(s.draft_tokens) == block - 1)
            for f in ((bare, engine) if rep % 2 == 0 else (engine, bare)):
                f()
            reps.append(r)
        if i:
            r = {k: statistics.median(x[k] for x in reps) for k in reps[0]}
            for k, v in r.items():
                rows[k].append(v)
            rows["engine_step_paired"].append(r["engine_step"] / r["bare_step_mean"])
            if "engine_verify" in r:
                rows["engine_verify_paired"].append(r["engine_verify"] / r["bare_verify"])
    med = {k: statistics.median(v) for k, v in rows.items() if v}
    return {"median_ms": med, "per_prompt_ms": rows, "prompts": len(prompts)}


def profile_summary(args, top: int = 15) -> str:
    """torch.profiler's top operators (self CPU time) over a Domino decode of the first prompt."""
    from torch.profiler import ProfilerActivity, profile

    from domino_lab import Target
    from domino_lab.data.eval_sets import load_eval_set
    from domino_lab.decoding import speculative_generate
    from domino_lab.models import load_drafter

    torch.set_num_threads(args.threads)
    target = Target.from_pretrained("default", dtype="float32")
    d = load_drafter("untrained:domino" if args.quick else DRAFTERS["domino"], target)
    prompt = load_eval_set(args.sets[0], limit=1)[0]["prompt"]
    speculative_generate(target, d, prompt=prompt, max_new_tokens=args.max_new_tokens)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        speculative_generate(target, d, prompt=prompt, max_new_tokens=args.max_new_tokens)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


def run_child(args, policy: str) -> dict:
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    if policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    cmd = [sys.executable, __file__, "--child", "--threads", str(args.threads), "--limit", str(args.limit),
           "--max-new-tokens", str(args.max_new_tokens), "--repeats", str(args.repeats), "--sets", *args.sets,
           "--drafters", *args.drafters,
           *(["--quick"] if args.quick else [])]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise UserError(f"measurement under OMP_WAIT_POLICY={policy} failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(res: dict, args, prof: str) -> str:
    lines = ["# Engine overhead and draft cost (embedded default, batch 1, greedy)", "",
             f"`python experiments/engine_overhead.py {' '.join(res['argv'])}`", "",
             f"Machine: {res['machine']}, {args.threads} torch threads, torch {torch.__version__}, {res['date']}. "
             f"{res['prompts']} prompts ({', '.join(args.sets)}, first {args.limit} each), {args.max_new_tokens} "
             f"new tokens; per prompt, the bare and engine measurements {args.repeats} times each, alternating which "
             "goes first, and each prompt's median; the table gives the median over prompts, in one process per "
             "policy and round.", "",
             "The engine's plain step is a mean ((wall − prefill) / steps); it is compared with the mean of the bare "
             "loop's steps (× bare: the ratio of the medians over prompts; paired: the median over prompts of each "
             "prompt's ratio, which a slow spell of the machine between prompts does not move), and the bare loop's "
             "median is shown beside it (× median).", "",
             "| OMP_WAIT_POLICY | bare 1-token forward, median / mean | engine plain step | × bare | paired | "
             "× median | bare 9-token verify forward | engine verify | × bare | paired | "
             + " | ".join(f"draft {d} (× plain step)" for d in args.drafters) + " |",
             "|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(args.drafters)]
    for pol, r in res["policies"].items():
        m = r["median_ms"]
        ev = m.get("engine_verify")
        mean = m["bare_step_mean"]
        pv = m.get("engine_verify_paired")
        lines.append(
            f"| {pol} | {m['bare_step']:.2f} / {mean:.2f} ms | {m['engine_step']:.2f} ms | "
            f"{m['engine_step'] / mean:.2f}× | {m['engine_step_paired']:.2f}× | "
            f"{m['engine_step'] / m['bare_step']:.2f}× | {m['bare_verify']:.2f} ms | "
            + (f"{ev:.2f} ms | {ev / m['bare_verify']:.2f}× | {pv:.2f}× | " if ev else "– | – | – | ")
            + " | ".join(f"{m[f'draft_{d}']:.2f} ms ({m[f'draft_{d}'] / m['engine_step']:.2f}×)" for d in args.drafters)
            + " |")
    lines += ["", "## Where a Domino decode spends its time (torch.profiler, self CPU time)", "", "```", prof, "```"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = CliParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", nargs="+", default=["math", "humaneval"])
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: what decoding the embedded default uses)")
    p.add_argument("--drafters", nargs="+", default=["dflash", "domino"], choices=list(DRAFTERS))
    p.add_argument("--omp-policies", nargs="+", default=["default"], choices=["default", "PASSIVE", "ACTIVE"])
    p.add_argument("--rounds", type=int, default=1, help="alternating rounds over the policies")
    p.add_argument("--repeats", type=int, default=3,
                   help="bare and engine measurements per prompt, alternating which goes first (paired ratios)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="folder for engine_overhead.{md,json} (default experiments/results)")
    args = p.parse_args(argv)
    if args.quick:
        args.limit, args.max_new_tokens, args.sets, args.repeats = 1, 12, args.sets[:1], 2
    if args.limit < 1 or args.max_new_tokens < 2 or args.threads < 1 or args.rounds < 1 or args.repeats < 1:
        raise UserError("--limit, --threads, --rounds and --repeats must be >= 1 and --max-new-tokens >= 2")
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    out = check_out_dir(args.out if args.out is not None else repo_root() / "experiments" / "results")
    per = {pol: [] for pol in args.omp_policies}
    for _ in range(args.rounds):
        for pol in args.omp_policies:
            per[pol].append(run_child(args, pol))
    policies = {}
    for pol, runs in per.items():
        keys = runs[0]["median_ms"].keys()
        policies[pol] = {"median_ms": {k: statistics.median(r["median_ms"][k] for r in runs) for k in keys},
                         "rounds": [r["median_ms"] for r in runs]}
    res = {"argv": list(argv if argv is not None else sys.argv[1:]), "date": time.strftime("%Y-%m-%d %H:%M UTC"),
           "machine": f"{cpu_line()}, {os.cpu_count()} CPUs",
           "prompts": per[args.omp_policies[0]][0]["prompts"],
           "policies": policies}
    prof = profile_summary(args)
    write_results(out, "engine_overhead", res, report(res, args, prof))
    return 0


if __name__ == "__main__":
    run_cli(main)
