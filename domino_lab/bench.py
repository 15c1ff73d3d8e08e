"""`python -m domino_lab.bench`: τ, per-position acceptance and speedup of our drafters against the decoders a
user would pick instead, measured in one run, interleaved, after warm-up.

Methods: `ar` (plain greedy through our engine), `hf` (`generate(do_sample=False)`), `hf-prompt-lookup`,
`hf-assisted` (a small autoregressive assistant of the same tokenizer), `dflash` and `domino` (our drafters), and
`domino-eager` / `domino-fast` / `domino-compiled` (the same Domino drafter with the eager reference head, the
fast head in torch ops, or its greedy rollout compiled by torch.compile; `domino` uses the drafter's own setting,
by default the fused C++ loop: what each head path costs per draft step), and `dflash-tree` / `domino-tree` (the same
two drafters verified as draft trees of `--tree-nodes` nodes, 32 by default, instead of chains).
Every method's tokens are checked against `ar`'s on every prompt (greedy decoding is lossless).

`--temperature T > 0` benches sampled decoding, prompt i with seed `--seed` + i for every method. With `--sampler
gumbel` the seed fixes the text (docs/design.md#gumbel-coupled-sampling), so our methods' samples are still checked
against `ar`'s, token for token; with the rejection sampler they are equal in distribution only (tested in
tests/test_sampling.py), and the `hf` methods sample with Hugging Face's own random stream: neither is compared.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .cli_flags import add_sampler_arg, add_threads_arg, check_greedy_flags
from .errors import CliParser, UserError, atomic_path, check_out_dir, run_cli

if TYPE_CHECKING:
    from .decoding.metrics import StepTally

METHODS = ("ar", "hf", "hf-prompt-lookup", "hf-assisted", "dflash", "domino-eager", "domino-fast", "domino-compiled",
           "domino", "dflash-tree", "domino-tree")
OURS = ("ar", "dflash", "domino-eager", "domino-fast", "domino-compiled", "domino", "dflash-tree", "domino-tree")
HEAD_VARIANTS = {"domino-eager": ("eager", 0), "domino-fast": ("fast", None),    # method -> (impl, pool)
                 "domino-compiled": ("compiled", None)}
TREE_METHODS = {"dflash-tree": "dflash", "domino-tree": "domino"}   # method -> the drafter slot it verifies as a tree
DEFAULT_METHODS = tuple(m for m in METHODS if m != "domino-compiled")
DEFAULT_TREE_NODES = 32


@dataclass
class Run:
    """One method on one prompt."""
    tokens: list[int]
    wall_s: float
    target_calls: int                      # verify forwards (prefill excluded)
    tally: StepTally | None = None         # the step records' counts (our engine only)


@dataclass(frozen=True)
class Sampling:
    """How every method decodes: greedy (T = 0, the default) or sampled, prompt i with seed `seed` + i."""
    temperature: float = 0.0
    top_p: float = 1.0
    sampler: str = "rejection"
    seed: int = 0

    def describe(self) -> str:
        if self.temperature == 0:
            return "greedy"
        return (f"sampled: T = {self.temperature:g}, top-p {self.top_p:g}, {self.sampler} sampler, seed {self.seed} "
                f"+ prompt index")


class Bench:
    def __init__(self, target, methods, drafters: dict, assistant=None, max_new_tokens: int = 128,
                 prompt_lookup_tokens: int = 10, tree_nodes: int = DEFAULT_TREE_NODES,
                 sampling: Sampling = Sampling()):
        self.target, self.methods, self.drafters = target, list(methods), drafters
        self.assistant, self.max_new, self.lookup = assistant, max_new_tokens, prompt_lookup_tokens
        self.tree_nodes = tree_nodes             # node budget of the *-tree methods
        self.sampling = sampling
        self.batch_threads: dict[int, int] = {}   # batch size -> the intra-op threads its batched decoding ran with
        self.calls = 0
        # counts target forwards inside HF generate (one per verification for the assisted methods)
        target.model.register_forward_pre_hook(self._count)

    def compared(self, method: str) -> bool:
        """Whether `method`'s tokens must equal `ar`'s: greedy, every method; sampled, our decoders under the gumbel
        sampler (the seed fixes the text; the hf methods sample from their own random stream)."""
        if method == "ar":
            return False
        s = self.sampling
        return s.temperature == 0 or (s.sampler == "gumbel" and (method in OURS or method in self.drafters))

    def _count(self, *_):
        self.calls += 1

    def run(self, method: str, ids: list[int], index: int = 0) -> Run:
        """`method` on one prompt; `index` (the prompt's place in its set) picks its sampling seed."""
        from .decoding import speculative_generate
        from .decoding.metrics import StepTally

        s = self.sampling
        if method in OURS or method in self.drafters:
            res = speculative_generate(self.target, self.drafters.get(method), prompt_ids=ids,
                                       max_new_tokens=self.max_new,
                                       tree_nodes=self.tree_nodes if method in TREE_METHODS else 0,
                                       temperature=s.temperature, top_p=s.top_p, sampler=s.sampler,
                                       seed=s.seed + index)
            n = self.drafters[method].config.num_drafts if method in self.drafters else 0
            return Run(res.token_ids, res.wall_time_s, len(res.steps), StepTally(n).add(res.steps))
        return self._hf(method, ids, index)

    def _hf(self, method: str, ids: list[int], index: int = 0) -> Run:
        import torch

        t, s = self.target, self.sampling
        eos = sorted(t.eos_token_ids)
        sample = s.temperature > 0
        kw = dict(max_new_tokens=min(self.max_new, t.max_length - len(ids)), do_sample=sample, num_beams=1,
                  eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0,
                  temperature=s.temperature if sample else None, top_p=s.top_p if sample else None, top_k=None)
        if sample:
            torch.manual_seed(s.seed + index)        # HF samples from torch's global stream
        if method == "hf-prompt-lookup":
            kw["prompt_lookup_num_tokens"] = self.lookup
        elif method == "hf-assisted":
            kw["assistant_model"] = self.assistant
        x = torch.tensor([ids], device=t.device)
        self.calls = 0
        t0 = time.perf_counter()
        with torch.no_grad():
            out = t.model.generate(x, attention_mask=torch.ones_like(x), **kw)
        wall = time.perf_counter() - t0
        new = out[0, len(ids):].tolist()
        for i, tok in enumerate(new):       # HF pads after EOS; our engine stops at it
            if tok in t.eos_token_ids:
                new = new[: i + 1]
                break
        return Run(new, wall, max(0, self.calls - 1))


def summarize(runs: list[Run], ref: list[Run] | None) -> dict:
    tokens = sum(len(r.tokens) for r in runs)
    wall = sum(r.wall_s for r in runs)
    calls = sum(r.target_calls for r in runs)
    from .decoding.metrics import StepTally

    tally = StepTally()
    for r in runs:
        if r.tally is not None:
            tally.merge(r.tally)
    # τ: tokens per verify forward; the prefill's token is not a step (same convention as the engine)
    tau = tally.tau if tally.steps else ((tokens - len(runs)) / calls if calls else None)
    out = {"prompts": len(runs), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall else 0.0,
           "tau": tau, "target_calls": calls}
    if tally.steps:
        t = tally.summary()
        out |= {"tau_hist": t["tau_hist"], "accept_pos": t["accept_pos"], "draft_ms": t["draft_ms"],
                "verify_ms": t["verify_ms"]}
    if ref is not None:
        bad = [i for i, (r, a) in enumerate(zip(runs, ref)) if r.tokens != a.tokens]
        out["lossless"] = {"equal": len(runs) - len(bad), "total": len(runs), "mismatch_prompts": bad}
    return out


def bench_set(b: Bench, prompts: list[dict], ids: list[list[int]], warmup: int, progress: bool = True) -> dict:
    from tqdm.auto import tqdm

    from .decoding.metrics import speedup_bound

    for x in ids[:warmup]:                      # warm-up: allocator, thread pools, HF's first-call work
        for m in b.methods:
            b.run(m, x)
    runs: dict[str, list[Run]] = {m: [] for m in b.methods}
    for i, x in enumerate(tqdm(ids, desc="bench", disable=not progress)):
        k = i % len(b.methods)                  # rotate the order so no method always runs first
        for m in b.methods[k:] + b.methods[:k]:
            runs[m].append(b.run(m, x, i))
    ref = runs.get("ar")
    res = {m: summarize(r, ref if b.compared(m) else None) for m, r in runs.items()}
    ar, hf = res.get("ar"), res.get("hf")
    for m, r in res.items():
        if ar:
            r["speedup_vs_ar"] = r["tokens_per_s"] / ar["tokens_per_s"]
        if hf:
            r["speedup_vs_hf"] = r["tokens_per_s"] / hf["tokens_per_s"]
        if ar and "draft_ms" in r and m != "ar":
            # cost model (paper §4): τ·t_ar / (t_draft + t_verify), with t_ar the plain step of this run
            r["bound_vs_ar"] = speedup_bound(r["tau"], ar["verify_ms"], r["draft_ms"], r["verify_ms"])
            r["measured_over_bound"] = r["speedup_vs_ar"] / r["bound_vs_ar"]
    res["_per_prompt"] = {m: [{"id": p["id"], "tokens": len(r.tokens), "wall_s": r.wall_s, "calls": r.target_calls}
                              for p, r in zip(prompts, rs)] for m, rs in runs.items()}
    return res


def batched_left_out(b: Bench) -> dict[str, str]:
    """Our decoders the batched table leaves out, with why (`ar` and the other drafters are measured)."""
    why = {}
    for m in b.methods:
        if m not in b.drafters:
            continue
        if m in HEAD_VARIANTS:
            why[m] = "a head-path variant of domino (the head's cost shows at batch 1)"
        elif m in TREE_METHODS:
            why[m] = "tree verification decodes one sequence at a time"
        elif not b.drafters[m].supports_batched:
            why[m] = f"{b.drafters[m].config.method} drafters decode one sequence at a time"
        elif b.drafters[m].options.draft_cutoff:
            why[m] = "the draft cutoff is an option of one-sequence decoding"
        elif b.drafters[m].options.block_size is not None:
            why[m] = "a block size is an option of one-sequence decoding"
    return why


def bench_batched(b: Bench, ids: list[list[int]], sizes: list[int], rounds: int = 1, progress: bool = True,
                  threads: int | None = None, continuous: bool = False) -> dict:
    """Throughput of batched decoding (ragged acceptance) for `ar` and our drafters at several batch sizes.
    Each size decodes the same prompts in consecutive batches, every method on a batch before the next batch (the
    order rotating per batch and per round, as the batch-1 bench rotates per prompt), `rounds` times: tokens/s is
    the median over rounds, the speedup the median of the per-round ratios (each against the `ar` run beside it),
    so a slow minute of the machine moves both sides of a ratio. `continuous`: each size is instead the number of
    slots through which all the prompts decode as one queue (decoding/batched.py). Outputs are checked against `ar`
    (sampled decoding batches with the gumbel sampler only, whose seed fixes the text)."""
    from tqdm.auto import tqdm

    from .decoding.batched import batched_generate
    from .target import decode_threads, torch_threads

    left_out = batched_left_out(b)
    methods = [m for m in b.methods if (m == "ar" or m in b.drafters) and m not in left_out]
    batched_generate(b.target, None, ids[:2], 4)                       # warm-up
    out: dict = {}
    bar = tqdm(total=sum(1 if continuous else -(-len(ids) // size) for size in sizes) * rounds * len(methods),
               desc="batched",
               disable=not progress)
    for size in sizes:
        # a batch's forwards are larger than one sequence's, so the thread count is chosen per batch size (`threads`
        # None: measured, target.decode_threads) and every method of the size runs with it
        with torch_threads(decode_threads(b.target, threads, rows=min(size, len(ids)))) as n_threads:
            out[size] = _bench_size(b, ids, size, rounds, methods, bar, continuous)
        b.batch_threads[size] = n_threads
    bar.close()
    return out


def interleaved_batches(configs: list, n_chunks: int, rounds: int, run, progress=None) -> tuple[dict, dict]:
    """Decode chunks 0..n_chunks-1 with every configuration, `rounds` times: every configuration on a chunk before the
    next chunk, the order rotating per chunk and per round, so a slow spell of the machine falls on all of them.
    run(config, chunk index) -> a BatchResult. Returns ({config: tokens/s of each round}, {config: the first round's
    results in chunk order}); `progress()` is called after every decode."""
    tally = {(r, c): [0, 0.0] for r in range(rounds) for c in configs}
    first: dict = {c: [] for c in configs}
    for r in range(rounds):
        for k in range(n_chunks):
            j = (r + k) % len(configs)
            for c in configs[j:] + configs[:j]:
                res = run(c, k)
                if progress is not None:
                    progress()
                tally[r, c][0] += sum(map(len, res.token_ids))
                tally[r, c][1] += res.wall_time_s
                if r == 0:
                    first[c].append(res)
    return {c: [tally[r, c][0] / tally[r, c][1] for r in range(rounds)] for c in configs}, first


def _bench_size(b: Bench, ids: list[list[int]], size: int, rounds: int, methods: list[str], bar,
                continuous: bool = False) -> dict:
    """bench_batched's measurement at one batch size: {method: its row}."""
    import statistics

    from .decoding.batched import batched_generate

    smp = b.sampling
    starts = range(0, len(ids), len(ids) if continuous else size)
    chunks = [ids[i:i + (len(ids) if continuous else size)] for i in starts]

    def run(m, c):
        # row r of a batch samples with seed + its prompt's index, as at batch 1
        return batched_generate(b.target, b.drafters.get(m), chunks[c], b.max_new, temperature=smp.temperature,
                                top_p=smp.top_p, sampler=smp.sampler, seed=smp.seed + starts[c], slots=size)

    per_round, first = interleaved_batches(methods, len(chunks), rounds, run, bar.update)
    # greedy or gumbel: every round decodes the same tokens, so the first round's are checked
    toks = {m: [t for res in first[m] for t in res.token_ids] for m in methods}
    row = {}
    for m in methods:
        speeds = per_round[m]
        lengths = [a for res in first[m] for row_ in res.acceptance_lengths for a in row_]
        row[m] = {"tokens_per_s": statistics.median(speeds), "tokens_per_s_rounds": speeds,
                  "tau": sum(lengths) / max(1, len(lengths)),
                  "lossless": sum(t == a for t, a in zip(toks[m], toks["ar"])),
                  "speedup_vs_ar": statistics.median(x / a for x, a in zip(speeds, per_round["ar"]))}
    return row


def batched_table(results: dict, n_prompts: dict) -> str:
    lines = ["| set | batch | method | τ | tokens/s | speedup vs batched ar | equal to ar |", "|" + "---|" * 7]
    for s, by_size in results.items():
        for size, row in by_size.items():
            for m, r in row.items():
                lines.append(f"| {s} | {size} | {m} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | "
                             f"{r['speedup_vs_ar']:.2f}x | {r['lossless']}/{n_prompts[s]} |")
    return "\n".join(lines)


def _fmt(v, f="{:.2f}"):
    return "–" if v is None else f.format(v)


def _times(v) -> str:
    """A ratio as "1.23x", or "–" without a number (no such method measured)."""
    return "–" if v is None else f"{v:.2f}x"


def table(results: dict) -> str:
    lines = ["| set | method | τ | tokens/s | speedup vs ar | speedup vs hf | draft ms | verify ms | bound vs ar "
             "| measured/bound | lossless | accept per position |", "|" + "---|" * 12]
    for s, res in results.items():
        for m, r in res.items():
            if m.startswith("_"):
                continue
            ll = r.get("lossless")
            pos = " ".join(_fmt(a) for a in r.get("accept_pos", [])) or "–"
            lines.append(f"| {s} | {m} | {_fmt(r['tau'])} | {r['tokens_per_s']:.1f} | {_times(r.get('speedup_vs_ar'))} | "
                         f"{_times(r.get('speedup_vs_hf'))} | {_fmt(r.get('draft_ms') if m != 'ar' else None)} | "
                         f"{_fmt(r.get('verify_ms'))} | "
                         f"{_fmt(r.get('bound_vs_ar'))} | {_fmt(r.get('measured_over_bound'))} | "
                         f"{(str(ll['equal']) + '/' + str(ll['total'])) if ll else 'ref' if m == 'ar' else '–'} | "
                         f"{pos} |")
    return "\n".join(lines)


def _savefig(fig, path: Path) -> None:
    with atomic_path(path, suffix=path.suffix) as tmp:
        fig.savefig(tmp, dpi=110)


def plots(results: dict, out_dir: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.6), squeeze=False)
    for ax, (s, res) in zip(axes[0], results.items()):
        for m, r in res.items():
            if r.get("accept_pos") if not m.startswith("_") else None:
                ax.plot(range(len(r["accept_pos"])), r["accept_pos"], marker="o", label=m)
        ax.set_title(f"{s}: acceptance per draft position"); ax.set_xlabel("position k"); ax.set_ylim(0, 1)
        if ax.lines:
            ax.legend()
        else:                      # e.g. only ar and hf methods: they keep no per-position records
            ax.text(0.5, 0.5, "no drafter of ours in this run", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout(); _savefig(fig, out_dir / "accept_pos.png"); plt.close(fig)
    paths.append(out_dir / "accept_pos.png")
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.6), squeeze=False)
    for ax, (s, res) in zip(axes[0], results.items()):
        ms = [m for m in res if not m.startswith("_") and res[m].get("speedup_vs_ar") is not None]
        ax.bar(ms, [res[m]["speedup_vs_ar"] for m in ms])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_title(f"{s}: speedup over ar"); ax.tick_params(axis="x", rotation=30)
    fig.tight_layout(); _savefig(fig, out_dir / "speedup.png"); plt.close(fig)
    paths.append(out_dir / "speedup.png")
    return paths


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(prog="python -m domino_lab.bench", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="default")
    p.add_argument("--sets", nargs="+", default=["math", "humaneval"], help="eval set names or JSONL files")
    p.add_argument("--methods", nargs="+", choices=METHODS, metavar="METHOD",
                   help=f"any of {', '.join(METHODS)} (default: all but domino-compiled, whose first call compiles "
                        "for about a minute, and those that cannot run on this target, e.g. trees on a target with "
                        "linear-attention layers; named ones that cannot run are an error)")
    p.add_argument("--domino", default=None, help="drafter for `domino`, `domino-tree` and the head variants "
                   "(checkpoint dir or shipped name; default: default)")
    p.add_argument("--dflash", default=None, help="drafter for `dflash` and `dflash-tree` (default: default-dflash)")
    p.add_argument("--assistant", default=None, help="assistant model for `hf-assisted` (default: default-assistant)")
    p.add_argument("--drafter", action="append", default=[], metavar="LABEL=SPEC[@key=value,...]",
                   help="also bench this drafter as method LABEL (repeat): a checkpoint dir or shipped name of any "
                        "registered method, or untrained:METHOD; after @, inference options of this label only, "
                        "e.g. domino-cut=default@draft_cutoff=0.2")
    from .models.options import BATCH_DRAFTS, add_inference_args
    add_inference_args(p)
    p.add_argument("--tree-nodes", type=int, default=DEFAULT_TREE_NODES, metavar="N",
                   help=f"node budget of the dflash-tree and domino-tree methods (default {DEFAULT_TREE_NODES})")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (the default); T > 0 samples every method, prompt i with seed --seed + i")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed of the first prompt of each set (T > 0)")
    add_sampler_arg(p)
    p.add_argument("--prompt-lookup-tokens", type=int, default=10)
    p.add_argument("--limit", type=int, default=None, help="first N prompts of every set")
    p.add_argument("--max-new-tokens", type=int, default=None, help="new tokens per prompt (default 128)")
    p.add_argument("--warmup", type=int, default=None,
                   help="prompts decoded by every method before timing (default 2)")
    p.add_argument("--dtype", default="float32")
    add_threads_arg(p)
    p.add_argument("--out", default=None, help="folder for bench.json, bench.md and the plots (default: the "
                                                "repository's runs/bench)")
    p.add_argument("--mlflow", action="store_true", help="also log bench/{set}/{method}/... to MLflow")
    p.add_argument("--tracking-uri", default=None)
    p.add_argument("--batch-sizes", nargs="*", type=int, default=[],
                   help="also measure batched decoding (ar and our drafters) at these batch sizes, e.g. 1 2 4 8 16")
    p.add_argument("--batch-rounds", type=int, default=1,
                   help="batched decoding: decode every batch this many times, methods interleaved; tokens/s is the "
                        "median over rounds and the speedup the median of per-round ratios (default 1)")
    p.add_argument("--continuous", action="store_true",
                   help="batched decoding: each batch size is the number of slots through which the whole set decodes "
                        "as one queue (a row that finishes hands its slot to the next prompt) instead of consecutive "
                        "batches of that size")
    p.add_argument("--batch-drafts", default=None, choices=BATCH_DRAFTS,
                   help="batched decoding: verify an adaptive number of drafts per step (the default: as many as pay "
                        "for their compute at the acceptance measured so far; 0 = a plain step) or the whole block; "
                        "per label: LABEL=SPEC@batch_drafts=all")
    p.add_argument("--project", default=None, metavar="REGIME_JSON",
                   help="also project each drafter's measured τ onto the target shapes of a regime map "
                        "(experiments/results/regime_map.json): bound = τ · t_step / (t_draft + t_verify) with that "
                        "shape's measured block-8 costs, labelled a projection")
    p.add_argument("--quick", action="store_true",
                   help="2 prompts per set, 16 new tokens, 1 warm-up (tests); flags given beside it win")
    return p


PROJECT_KEYS = ("step_ms", "draft_8_ms", "verify_8_ms")


def load_regime(path: str) -> dict:
    """{shape: costs} from a regime map JSON (experiments/regime_map.py), checked before anything is decoded."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UserError(f"--project {path}: cannot read it ({e.strerror}); give the JSON that "
                        "experiments/regime_map.py wrote (experiments/results/regime_map.json)") from None
    try:
        shapes = json.loads(text)["results"]
        if not shapes or any(not all(isinstance(c.get(k), (int, float)) for k in PROJECT_KEYS)
                             for c in shapes.values()):
            raise KeyError
    except (ValueError, KeyError, TypeError, AttributeError):
        raise UserError(f"--project {path}: not a regime map (a JSON with results: {{shape: {{"
                        f"{', '.join(PROJECT_KEYS)}}}}}); write one with experiments/regime_map.py") from None
    return shapes


def projection(results: dict, shapes: dict, methods: list[str]) -> dict:
    """{set: {method: {shape: bound}}} for `methods` (block drafters verified as chains, whose costs the regime map
    measures): the measured τ times a shape's step over its draft + verify (block 8). A projection, not a
    measurement: a drafter for that target would have its own τ and draft cost."""
    from .decoding.metrics import speedup_bound

    out: dict = {}
    for s, res in results.items():
        for m, r in res.items():
            if m not in methods or not r.get("tau"):
                continue
            out.setdefault(s, {})[m] = {
                name: speedup_bound(r["tau"], c["step_ms"], c["draft_8_ms"], c["verify_8_ms"])
                for name, c in shapes.items()}
    return out


def projection_table(proj: dict, path: str) -> str:
    shapes = list(next(iter(next(iter(proj.values())).values())))
    lines = [f"Projected speedup bound on other target shapes (**a projection, not a measurement**: the τ measured "
             f"here times each shape's measured block-8 step, draft and verify costs from `{path}`):", "",
             "| set | method | " + " | ".join(shapes) + " |", "|---|---|" + "---|" * len(shapes)]
    for s, res in proj.items():
        for m, row in res.items():
            lines.append(f"| {s} | {m} | " + " | ".join(f"{row[n]:.2f}×" for n in shapes) + " |")
    return "\n".join(lines)


def check_sampling_args(smp: Sampling, options: list, prompts: int, batched: bool) -> None:
    """One clear error, before any model loads, for sampling settings some method could not decode with."""
    from . import sampling
    from .validation import check_seed

    for o in options or [None]:
        sampling.check_sampling(smp.temperature, smp.top_p, smp.sampler, bool(o and o.tree_sampled))
    check_seed(smp.seed, "--seed")
    check_seed(smp.seed + prompts - 1, "--seed + the prompt index")
    if batched and smp.temperature > 0 and smp.sampler != "gumbel":
        raise UserError("--batch-sizes at --temperature > 0 needs --sampler gumbel (batched decoding samples with the "
                        "gumbel sampler only)")


def agreement(smp: Sampling) -> str:
    """What the bench checked about the methods' outputs (when every check passed)."""
    if smp.temperature == 0:
        return "Every method's output equals `ar`'s on every prompt."
    if smp.sampler == "gumbel":
        return ("Every one of our methods samples exactly `ar`'s text on every prompt (the gumbel sampler: the seed "
                "fixes the text); the hf methods sample from their own random stream and are not compared.")
    return ("Sampled with the rejection sampler: each method's output is a sample of the same distribution (tested "
            "in tests/test_sampling.py), so outputs are not compared token for token.")


def param_mb(model) -> float:
    """A model's parameters in MB (shared tensors once)."""
    return round(sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6, 2)


def weights_line(weights_mb: dict, cache: tuple[int, float] | None) -> str:
    """The models' weights against the processor's last-level cache: a speculative decode alternates the target
    and a drafter, so whether both fit in that cache changes what a draft step costs after a verify
    (docs/design.md#cpu-caches)."""
    from .target import cache_size

    parts = ", ".join(f"{k} {v:.1f} MB" for k, v in weights_mb.items())
    where = (f"this processor's last-level cache (L{cache[0]}) holds {cache_size(cache[1])}" if cache else
             "the OS reports no cache size")
    return f"Weights: {parts}; {where} (docs/design.md#cpu-caches)."


def load_assistant(spec: str, target, dtype):
    from transformers import AutoModelForCausalLM

    path = Path(__file__).parent / "assets" / "assistant" if spec == "default-assistant" else Path(spec)
    if not (Path(path) / "config.json").exists():
        raise UserError(f"assistant '{spec}' is not a model directory; train one with "
                        "`python -m domino_lab.pretrain --config experiments/configs/assistant.yaml` "
                        "or drop hf-assisted from --methods")
    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=target.dtype).to(target.device).eval()
    if m.get_output_embeddings().weight.shape[0] != target.vocab_size:
        raise UserError(f"assistant '{spec}' has another vocabulary than the target; it must share the tokenizer")
    return m


SLOT_DEFAULTS = {"domino": "default", "dflash": "default-dflash", "assistant": "default-assistant"}


def check_slots(args) -> None:
    """A drafter or assistant flag that none of the benched methods reads is an error (a typo'd method list would
    otherwise bench something else than the user asked for, silently); unset slots get their defaults."""
    users = {"domino": ["domino", *HEAD_VARIANTS, "domino-tree"], "dflash": ["dflash", "dflash-tree"],
             "assistant": ["hf-assisted"]}
    for slot, default in SLOT_DEFAULTS.items():
        if getattr(args, slot) is None:
            setattr(args, slot, default)
        elif not any(m in args.methods for m in users[slot]):
            raise UserError(f"--{slot} is read by the methods {', '.join(users[slot])}, and none of them is benched: "
                            f"add one to --methods, or drop --{slot}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    named = args.methods is not None         # methods the user asked for fail loudly; defaults are skipped instead
    if not named:
        args.methods = list(DEFAULT_METHODS)
    # --quick's sizes, or the defaults, for what was not given
    for flag, quick, default in (("limit", 2, None), ("max_new_tokens", 16, 128), ("warmup", 1, 2)):
        if getattr(args, flag) is None:
            setattr(args, flag, quick if args.quick else default)
    batch_flags = [flag for flag, on in (("--continuous", args.continuous), ("--batch-rounds", args.batch_rounds != 1),
                                         ("--batch-drafts", args.batch_drafts is not None)) if on]
    if batch_flags and not args.batch_sizes:
        raise UserError(f"{batch_flags[0]} shapes the batched rows, and this run measures batch 1 only: add "
                        f"--batch-sizes or drop {batch_flags[0]}")
    check_greedy_flags(args)
    if args.tracking_uri is not None and not args.mlflow:
        raise UserError("--tracking-uri says where --mlflow logs: add --mlflow, or drop --tracking-uri")
    for flag in ("max_new_tokens", "prompt_lookup_tokens"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be at least 1")
    from .decoding.tree import check_tree_nodes

    if check_tree_nodes(args.tree_nodes, "--tree-nodes") == 0 and not named:
        args.methods = [m for m in args.methods if m not in TREE_METHODS]      # 0 nodes = chains only
    trees = [m for m in args.methods if m in TREE_METHODS]
    if args.tree_nodes == 0 and trees:
        raise UserError("--tree-nodes must be >= 1 for the dflash-tree and domino-tree methods (0 is the chain: "
                        "bench dflash / domino for that)")
    check_slots(args)
    tree_flags = [f for f in ("tree_min_prob", "tree_sampled") if getattr(args, f) is not None]
    if tree_flags and not trees:
        raise UserError(f"--{tree_flags[0].replace('_', '-')} shapes the trees of the dflash-tree and domino-tree "
                        "methods, and none is benched: add one to --methods or drop the flag")
    if args.draft_cutoff and trees:
        raise UserError(f"--draft-cutoff shortens chains, and {trees[0]} verifies a tree (bounded by --tree-min-prob "
                        "instead): give --methods without the tree methods, or drop --draft-cutoff")
    if any(x < 1 for x in args.batch_sizes):
        raise UserError("--batch-sizes must be positive integers")
    if args.batch_rounds < 1:
        raise UserError(f"--batch-rounds must be >= 1, got {args.batch_rounds}")
    if args.warmup < 0:
        raise UserError("--warmup must be >= 0")
    from .config import default_runs_dir

    # where the results go is checked now, not after the whole bench has run
    out = check_out_dir(args.out if args.out is not None else default_runs_dir() / "bench")
    if args.mlflow:
        from .training.tracking import check_tracking_uri

        check_tracking_uri(args.tracking_uri, "--tracking-uri")
    from .data.eval_sets import load_eval_set, prompts_digest, prompts_line

    # bad names fail before any model loads; a JSONL file is reported under its stem
    labels = [Path(s).stem if s.endswith(".jsonl") else s for s in args.sets]
    for i, label in enumerate(labels):
        if label in labels[:i]:
            raise UserError(f"--sets {args.sets[labels.index(label)]} and {args.sets[i]} would both be reported as "
                            f"{label!r}; give each set once, and JSONL files different names")
    sets = {label: load_eval_set(s, limit=args.limit) for label, s in zip(labels, args.sets)}
    regime = load_regime(args.project) if args.project else None
    from dataclasses import asdict, replace

    from .decoding.engine import check_tree_mode
    from .models import InferenceOptions, packed_linear
    from .models.drafter import load_item
    from .models.options import TREE_FLAGS, DrafterItem, drafter_items
    from .target import Target, last_level_cache, machine_line, openmp_waits, use_decode_threads

    options = InferenceOptions.from_args(args)
    smp = Sampling(args.temperature, args.top_p, args.sampler, args.seed)
    # drafter slot -> its item: the two named slots, the head variants of `domino`, then --drafter LABEL=SPEC
    specs = {m: DrafterItem(m, getattr(args, m), options) for m in ("dflash", "domino") if m in args.methods}
    specs |= {m: DrafterItem(m, getattr(args, slot), options)
              for m, slot in TREE_METHODS.items() if m in args.methods}
    for m, (impl, pool) in HEAD_VARIANTS.items():
        if m in args.methods:
            specs[m] = DrafterItem(m, args.domino, replace(
                options, head_impl=impl, candidate_pool=options.candidate_pool if pool is None else pool))
    items = drafter_items(args.drafter, options, reserved=METHODS)
    for it in items:
        shaping = [k for k in it.keys if k in TREE_FLAGS]
        if shaping:         # a label is benched as a chain: the option would be ignored without a word
            raise UserError(f"--drafter {it.item!r}: {shaping[0]} shapes a draft tree, and a "
                            "--drafter label is benched as a chain: bench the tree with --methods domino-tree (or "
                            f"dflash-tree) and --{shaping[0].replace('_', '-')}, or compare a drafter's chain and "
                            "trees with experiments/tree.py")
        specs[it.label] = it
    extra = [it.label for it in items]
    check_sampling_args(smp, [it.options for it in specs.values()], max(map(len, sets.values())),
                        bool(args.batch_sizes))
    target = Target.from_pretrained(args.target, dtype=args.dtype)
    from .decoding.engine import prompts_token_ids

    # every prompt's ids, checked to fit the context before anything is decoded
    ids = {name: prompts_token_ids(target, prompts, f"set {name}") for name, prompts in sets.items()}
    use_decode_threads(target, args.threads)
    drafters = {m: load_item(it, target) for m, it in specs.items()}
    # the two named slots say what their methods measure: `dflash` a block drafter alone, `domino` one with its head
    for m, d in drafters.items():
        slot = TREE_METHODS.get(m, "domino" if m in HEAD_VARIANTS else m)
        if slot in ("dflash", "domino") and d.uses_head != (slot == "domino"):
            spec = getattr(args, slot)
            raise UserError(f"--{slot} {spec}: the {m} method measures "
                            + ("a drafter with the Domino head, and this one has none" if slot == "domino" else
                               "a block drafter without a head, and this one drafts with its head")
                            + f"; give --{slot} such a drafter, or bench this one under its own label: "
                            f"--drafter LABEL={spec}")
    skipped: dict[str, str] = {}     # default methods this target cannot run -> why

    def skip(method: str, error: UserError) -> None:
        if named:
            raise error
        skipped[method] = str(error)
        print(f"skipping {method}: {error}", file=sys.stderr)

    for m in TREE_METHODS:          # a target whose layers a tree cannot verify: one error up front
        if m in drafters:
            try:
                check_tree_mode(drafters[m])
            except UserError as e:
                skip(m, e)
                del drafters[m], specs[m]
    assistant = None
    if "hf-assisted" in args.methods:
        try:
            assistant = load_assistant(args.assistant, target, args.dtype)
        except UserError as e:
            skip("hf-assisted", e)
    methods = [m for m in METHODS if m in args.methods and m not in skipped] + extra
    if "ar" not in methods:
        methods.insert(0, "ar")     # the reference for losslessness and speedup
    b = Bench(target, methods, drafters, assistant, args.max_new_tokens, args.prompt_lookup_tokens, args.tree_nodes,
              smp)
    started = time.time()
    results = {s: bench_set(b, prompts, ids[s], args.warmup) for s, prompts in sets.items()}
    batched = ({s: bench_batched(b, ids[s], args.batch_sizes, args.batch_rounds, threads=args.threads,
                                 continuous=args.continuous)
                for s, prompts in sets.items()} if args.batch_sizes else {})
    meta = {"command": "python -m domino_lab.bench " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": machine_line(openmp_waits()),
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "prompts": {name: prompts_digest(prompts) for name, prompts in sets.items()},
            "target": args.target, "dtype": str(target.dtype).removeprefix("torch."),
            "drafters": {m: it.spec for m, it in specs.items()},
            "options": {m: asdict(it.options) for m, it in specs.items()},
            "domino_head": asdict(drafters["domino"].options) if "domino" in drafters else None,
            "max_new_tokens": args.max_new_tokens, "wall_s": round(time.time() - started, 1),
            "sampling": asdict(smp),
            "tree_nodes": args.tree_nodes if set(TREE_METHODS) & set(methods) else None,
            # our decoders read greedy tokens through the half-precision head screen where the head allows it
            # (exact; docs/design.md#greedy-head-screen); the hf methods always read the full head
            "lm_head": "screen" if target.screen is not None else "full",
            # which read each kind of greedy call took, and which weight shapes took oneDNN's packed product: both
            # are timed per process (docs/design.md#packed-linears), so a run records what it used
            "lm_head_reads": target.screen.decisions() if target.screen is not None else {},
            "linear_kernels": packed_linear.choices(),
            # the batch-1 rows ran with the machine line's threads, batched decoding with these per batch size
            "batched_threads": b.batch_threads, "batched_continuous": args.continuous, "skipped": skipped,
            "batched_left_out": batched_left_out(b) if batched else {},
            # (parameters only: the target's tied embedding counts once; a drafter's tables built from it not at all)
            "weights_mb": {"target": param_mb(target.model)} | {f"drafter {specs[m].spec}": param_mb(d)
                                                                for m, d in drafters.items()},
            "last_level_cache": last_level_cache()}
    md = table(results)
    # block drafters verified as chains with their own head path: what the regime map's costs are of
    chains = [m for m in methods if m in drafters and hasattr(drafters[m], "tree_expander")
              and m not in TREE_METHODS and m not in HEAD_VARIANTS]
    proj = projection(results, regime, chains) if regime else {}
    with atomic_path(out / "bench.json") as t:
        t.write_text(json.dumps({"meta": meta, "results": results, "batched": batched,
                                 **({"projection": {"source": args.project, "bounds": proj}} if proj else {})},
                                indent=1))
    pngs = plots(results, out)
    notes = []
    for s, res in results.items():
        for m, r in res.items():
            ll = r.get("lossless") if not m.startswith("_") else None
            if ll and ll["equal"] != ll["total"]:
                notes.append(f"**{s}/{m}: output differs from `ar` on {ll['total'] - ll['equal']} prompt(s) "
                             f"{ll['mismatch_prompts'][:10]}.**")
        for size, row in batched.get(s, {}).items():
            for m, r in row.items():
                if r["lossless"] != len(sets[s]):
                    notes.append(f"**{s}/batch {size}/{m}: output differs from `ar` on "
                                 f"{len(sets[s]) - r['lossless']} prompt(s).**")
    if notes and meta['dtype'] in ("bfloat16", "float16"):
        notes.append(f"In {meta['dtype']} a verify of several tokens and a one-token step round differently, so where "
                     "two tokens nearly tie speculative output can leave plain decoding (Hugging Face's prompt lookup "
                     "does too); exactness is float32's and float64's.")
    text = (f"`{meta['command']}`\n\n{meta['machine']}; {meta['date']}; {meta['wall_s']} s; {meta['dtype']}; "
            f"{smp.describe()}"
            + (f"; greedy LM head: {meta['lm_head']}" if smp.temperature == 0 else "")
            + (" (" + ", ".join(f"{k}: {v}" for k, v in meta["lm_head_reads"].items()) + ")"
               if smp.temperature == 0 and meta["lm_head_reads"] else "")
            + f"; linear kernels: {packed_linear.describe(meta['linear_kernels'])}"
            + "; prompts: " + prompts_line(meta["prompts"])
            + f"\n\n{md}\n\n"
            + ("\n".join(notes) + "\n\n" if notes else agreement(smp) + "\n\n")
            + "".join(f"Skipped `{m}` (not named in --methods): {why}\n\n" for m, why in skipped.items())
            + ("Batched decoding (ragged acceptance; "
               + ("each set one queue through that many slots" if args.continuous
                  else "same prompts in consecutive batches") + "; torch threads per batch "
               f"size: {', '.join(f'{k}: {v}' for k, v in b.batch_threads.items())}):\n\n"
               f"{batched_table(batched, {s: len(p) for s, p in sets.items()})}\n\n"
               + "".join(f"Not in the batched table: `{m}` ({why}).\n" for m, why in meta["batched_left_out"].items())
               + ("\n" if meta["batched_left_out"] else "") if batched else "")
            + (projection_table(proj, args.project) + "\n\n" if proj else "")
            + weights_line(meta["weights_mb"], meta["last_level_cache"]) + "\n\n"
            + "\n".join(f"![{p.stem}]({p.name})" for p in pngs) + "\n")
    with atomic_path(out / "bench.md") as t:
        t.write_text(text)
    if args.mlflow:
        _log_mlflow(results, meta, out, args.tracking_uri)
    print(md)
    print("\n".join(notes) or agreement(smp), file=sys.stderr)
    print(f"wrote {out / 'bench.md'} and {out / 'bench.json'}", file=sys.stderr)
    return 1 if notes else 0


def _log_mlflow(results: dict, meta: dict, out: Path, uri: str | None) -> None:
    import mlflow

    from .training.tracking import default_tracking_uri, ensure_experiment, mlflow_key

    uri = uri or default_tracking_uri()
    mlflow.set_tracking_uri(uri)
    # created with the project's artifact location (beside a SQLite store), not MLflow's ./mlruns of the cwd
    mlflow.set_experiment(experiment_id=ensure_experiment(uri, "bench"))
    with mlflow.start_run(run_name=f"bench-{meta['date']}"):
        mlflow.log_params({"target": meta["target"], "max_new_tokens": meta["max_new_tokens"],
                           **{f"sampling.{k}": v for k, v in meta["sampling"].items()},
                           **{mlflow_key(f"drafter.{k}"): v for k, v in meta["drafters"].items()}})
        for s, res in results.items():
            for m, r in res.items():
                if m.startswith("_"):
                    continue
                for k in ("tau", "tokens_per_s", "speedup_vs_ar", "speedup_vs_hf"):
                    if r.get(k) is not None:
                        mlflow.log_metric(mlflow_key(f"bench/{s}/{m}/{k}"), r[k])
        mlflow.log_artifacts(str(out))


if __name__ == "__main__":
    run_cli(main)
