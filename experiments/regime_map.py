"""Where speculative decoding pays on this CPU: for Qwen3-shaped targets from the embedded 6.8M model up to the
shape of Qwen3-0.6B, the measured cost of a plain decoding step, of verifying a block of 8 / 16 drafts, and of a
matching Domino drafter's draft step, and the speedup bound τ · t_step / (t_draft + t_verify) at τ = 2…6 and at
the shipped Domino drafter's measured τ on every bench set (read from experiments/results/bench/bench.json); and the
same for tree verification: drafting and verifying a tree of N nodes (default 32) against a chain of 8, and what
the tree's measured τ gain on the embedded default (experiments/results/tree_n32/tree.json) would be worth in
tokens per second on each shape.

    python experiments/regime_map.py                        # -> experiments/results/regime_map.{md,json,png}
    python experiments/regime_map.py --quick --out /tmp/r   # two tiny shapes (tests)
    python experiments/regime_map.py --dtype bfloat16 --out experiments/results/regime_map_amx/bfloat16

Random weights (timing does not depend on them) except the embedded default, which is the shipped target. Every
quantity is the median wall time over interleaved repetitions with a 128-token context in the caches, as inside a
decode; the drafter is an untrained Domino drafter shaped for the target (two draft layers as shipped, 3 taps, the
fused head with its 64-token candidate pool) drafting over an FR-Spec list: 1,024 ids for the embedded default (as the
shipped drafters) and `--frspec-k` ids (default 32,768, FR-Spec's size for a 152K vocabulary) for the others,
chosen at random (timing only). Threads per shape as decoding picks them (`target.use_decode_threads`: one thread or both
cores for the embedded default, whichever measures faster, both cores for the larger shapes) unless `--threads` says otherwise. The bound is what the
engine delivers when it adds no overhead (the committed bench measures 96–102% of it on the embedded default).
A tree step is timed as the engine runs it: the backbone pass and the best-first tree (`build_tree`, the head
stepping along every kept branch), then one target forward over the anchor and the N nodes with the tree's
attention mask and positions, the LM head on the walk's likely rows only (the anchor and its line of best
children). The untrained drafter's tree has the budget's node count, which is what the forward's cost depends on.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

from domino_lab import Drafter, Target
from domino_lab.bench import projection
from domino_lab.decoding.metrics import speedup_bound
from domino_lab.config import repo_root
from domino_lab.errors import CliParser, check_out_file, run_cli
from domino_lab.experiments.results import write_results
from domino_lab.decoding import tree as trees
from domino_lab.experiments.timing import cached_step, cached_tree_step
from domino_lab.target import cpu_line, default_tap_layers, parse_dtype, use_decode_threads

# name: (hidden, layers, heads, kv heads, head_dim, intermediate, vocab); Qwen3-0.6B's published shape last
SHAPES = {
    "embedded default (6.8M)": None,
    "Qwen3-shaped 0.13B": (512, 12, 8, 4, 64, 1536, 151936),
    "Qwen3-shaped 0.29B": (768, 18, 12, 4, 64, 2304, 151936),
    "Qwen3-0.6B shape": (1024, 28, 16, 8, 128, 3072, 151936),
}
QUICK = {"tiny A": (64, 2, 4, 2, 16, 128, 512), "tiny B": (128, 4, 4, 2, 32, 256, 2048)}
TAUS = (2, 3, 4, 5, 6)
CTX = 128


def build_target(shape, dtype: torch.dtype = torch.float32) -> Target:
    if shape is None:
        return Target.from_pretrained("default", dtype=dtype)
    h, layers, heads, kv, hd, inter, vocab = shape
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, max_position_embeddings=2048,
                      tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg).to(dtype).eval()
    return Target(model, None, mask_token_id=vocab - 1, taps=default_tap_layers(layers, 3))


def cpu_matrix_units() -> str:
    """The CPU's bf16 / matrix extensions as /proc/cpuinfo names them (they decide what bfloat16 costs here)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "CPU flags unknown"
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    found = [f for f in ("avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return ", ".join(found) if found else "no bf16 matrix units"


def measure(target: Target, reps: int, rounds: int, frspec_k: int, draft_layers: int = 2, tree_nodes: int = 32
            ) -> dict:
    g = torch.Generator().manual_seed(0)
    params = sum(p.numel() for p in target.model.parameters())
    prompt = torch.randint(1, target.vocab_size - 1, (1, CTX), generator=g)
    cache = DynamicCache(config=target.model.config)
    target.forward(prompt, cache=cache, taps=list(target.taps))

    def verify(k: int):
        def run():
            ids = torch.randint(1, target.vocab_size - 1, (1, k), generator=g)
            # as the engine verifies a greedy chain: every row's next token, through the head screen if any
            target.forward(ids, cache=cache, taps=list(target.taps),
                           position_ids=torch.arange(CTX, CTX + k)[None], greedy=True).tokens.tolist()
            cache.crop(-k)
        return run

    draft_vocab = min(frspec_k, target.vocab_size)
    ids = torch.randperm(target.vocab_size, generator=g)[:draft_vocab].tolist()
    drafters = {b: Drafter.untrained(target, "domino", block_size=b, num_layers=draft_layers,
                                     frspec_k=draft_vocab).set_frspec(ids) for b in (8, 16)}
    for d in drafters.values():
        d.eval()                  # (in the target's dtype: a drafter binds to its target's device and dtype)
    runs = {"step": verify(1), "verify_8": verify(9), "verify_16": verify(17),
            "draft_8": cached_step(drafters[8], CTX, g), "draft_16": cached_step(drafters[16], CTX, g)}
    if tree_nodes:
        runs["draft_tree"] = cached_tree_step(drafters[8], CTX, g, tree_nodes)
        with torch.no_grad():
            runs["verify_tree"] = verify_tree(target, cache, runs["draft_tree"](), g)
    times = {k: [] for k in runs}
    with torch.no_grad():
        for f in runs.values():           # warm-up (allocator, the fused head's kernel and tables)
            f()
        for _ in range(rounds):
            for k, f in runs.items():
                for _ in range(reps):
                    t0 = time.perf_counter()
                    f()
                    times[k].append(time.perf_counter() - t0)
    ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
    out = {"params": params, "threads": torch.get_num_threads(), "draft_vocab": draft_vocab,
           **{f"{q}_ms": v for q, v in ms.items()}}
    if tree_nodes:
        out["tree_nodes"] = tree_nodes
        # the τ gain over the chain of 8 at which a tree step breaks even in tokens per second
        out["tree_cost_ratio"] = (ms["draft_tree"] + ms["verify_tree"]) / (ms["draft_8"] + ms["verify_8"])
    for b in (8, 16):
        cost = ms[f"draft_{b}"] + ms[f"verify_{b}"]
        out[f"bound_{b}"] = {str(t): speedup_bound(t, ms["step"], ms[f"draft_{b}"], ms[f"verify_{b}"]) for t in TAUS}
        out[f"tau_for_1x_{b}"] = cost / ms["step"]          # break-even τ
        out[f"tau_for_2x_{b}"] = 2 * cost / ms["step"]
    return out


def verify_tree(target: Target, cache, tree: trees.Tree, g: torch.Generator):
    """A tree verify as the engine runs it: one forward over [anchor, nodes] with the tree's mask and positions on
    a cache holding CTX positions, the LM head on the walk's likely rows, then the nodes cut off again."""
    mask = trees.attention_mask(tree, CTX, target.dtype, target.device)
    pos = trees.positions(tree, CTX, target.device)
    rows = trees.likely_rows(tree)

    def run():
        ids = torch.randint(1, target.vocab_size - 1, (1, len(tree) + 1), generator=g)
        out = target.forward(ids, cache=cache, taps=list(target.taps), attention_mask=mask, position_ids=pos,
                             logits_rows=[])
        target.greedy_tokens(out.hidden[0, rows]).tolist()
        cache.crop(-(len(tree) + 1))
    return run


def tree_gains(path: Path, nodes: int) -> dict:
    """{set: Domino's τ with a tree of `nodes` nodes ÷ its chain τ} from an experiments/tree.py result, or {}."""
    if not path.exists():
        return {}
    res = json.loads(path.read_text())["results"]
    return {s_: r[f"domino@{nodes}"]["tau"] / r["domino@0"]["tau"] for s_, r in res.items()
            if f"domino@{nodes}" in r and "domino@0" in r}


def render_tree(res: dict, gains: dict, source: str) -> list[str]:
    """The tree section: per shape the tree step's cost against the chain's, and what each set's measured τ gain
    would make of it in tokens per second (a projection, as the τ section's)."""
    nodes = next(iter(res.values()))["tree_nodes"]
    lines = ["", f"## Tree verification ({nodes} nodes) against a chain of 8", "",
             "Tokens per second of a tree step ÷ a chain step = (τ gain of the tree) ÷ (tree step cost ÷ chain step "
             "cost); the cost ratio is the τ gain at which the tree breaks even."
             + (f" τ gains measured on the embedded default with the shipped Domino drafter (`{source}`)." if gains
                else ""), "",
             "| target | chain: draft + verify ms | tree: draft + verify ms | tree ÷ chain cost (break-even τ gain) |"
             + "".join(f" {s_} (τ ×{gn:.2f}) |" for s_, gn in gains.items()),
             "|" + "---|" * (4 + len(gains))]
    for name, r in res.items():
        ratio = r["tree_cost_ratio"]
        lines.append(f"| {name} | {r['draft_8_ms']:.1f} + {r['verify_8_ms']:.1f} | {r['draft_tree_ms']:.1f} + "
                     f"{r['verify_tree_ms']:.1f} | {ratio:.2f} |" + "".join(f" {gn / ratio:.2f}× |" for gn in gains.values()))
    return lines


def render(res: dict, meta: dict, shipped: dict, proj: dict, gains: dict | None = None) -> str:
    lines = ["# Regime map: where speculative decoding pays on this CPU", "",
             f"`{meta['command']}`", "",
             f"Machine: {meta['machine']}, {meta['date']}. Random weights except the embedded default; median wall "
             f"time, {CTX}-token context; untrained Domino drafter ({meta['draft_layers']} draft layers, "
             f"{'the fast head: the fused C++ loop runs float32 and float64 only' if meta.get('dtype') == 'bfloat16' else 'fused head'}, "
             "pool 64) drafting over an "
             "FR-Spec list of the size shown. Bound = τ · t_step / (t_draft + t_verify).", "",
             "| target | params | threads | draft vocab | step ms | verify 8 ms | verify 16 ms | draft 8 ms | "
             "draft 16 ms | draft/step (8) | τ for 1× (8 / 16) | τ for 2× (8 / 16) | bound at τ 2 / 4 / 6 (block 8) | "
             "bound at τ 2 / 4 / 6 (block 16) |",
             "|" + "---|" * 14]
    for name, r in res.items():
        b8, b16 = r["bound_8"], r["bound_16"]
        lines.append(
            f"| {name} | {r['params'] / 1e6:.1f}M | {r['threads']} | {r['draft_vocab']:,} | {r['step_ms']:.1f} | "
            f"{r['verify_8_ms']:.1f} | {r['verify_16_ms']:.1f} | {r['draft_8_ms']:.1f} | {r['draft_16_ms']:.1f} | "
            f"{r['draft_8_ms'] / r['step_ms']:.2f} | {r['tau_for_1x_8']:.2f} / {r['tau_for_1x_16']:.2f} | "
            f"{r['tau_for_2x_8']:.2f} / {r['tau_for_2x_16']:.2f} | "
            f"{b8['2']:.2f} / {b8['4']:.2f} / {b8['6']:.2f} | {b16['2']:.2f} / {b16['4']:.2f} / {b16['6']:.2f} |")
    if proj:
        lines += ["", "## At the shipped Domino drafter's measured τ (block 8)", "",
                  f"τ per set from `{meta['tau_source']}`; projected speedup bound on each shape (a projection: the τ "
                  "was measured on the embedded target, and a larger target's drafter would have its own).", "",
                  "| target | " + " | ".join(f"{s_} (τ {t:.2f})" for s_, t in shipped.items()) + " |",
                  "|---|" + "---|" * len(shipped)]
        for name in res:
            lines.append(f"| {name} | " + " | ".join(f"{proj[s_]['domino'][name]:.2f}×" for s_ in shipped) + " |")
        for s_, t in shipped.items():
            bound = proj[s_]["domino"]
            pays = [n for n in res if bound[n] >= 1]
            two = [n for n in res if bound[n] >= 2]
            lines.append(f"\n{s_} (τ {t:.2f}): beats plain decoding on {', '.join(pays) or 'none of these shapes'}; "
                         f"reaches 2× on {', '.join(two) or 'none of these shapes'}.")
    if any("tree_nodes" in r for r in res.values()):
        lines += render_tree(res, gains or {}, meta["tree_source"])
    return "\n".join(lines) + "\n"


def bench_results(path: Path) -> dict:
    """The `results` of a bench.json ({set: {method: {tau, ...}}}), or {} when there is none."""
    return json.loads(path.read_text())["results"] if path.exists() else {}


def plot(res: dict, out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for name, r in res.items():
        ax.plot(TAUS, [r["bound_8"][str(t)] for t in TAUS], marker="o", label=f"{name} ({r['params'] / 1e6:.0f}M)")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.axhline(2.0, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("τ (tokens per target call), block 8")
    ax.set_ylabel("speedup bound over plain decoding")
    ax.set_title("Where speculative decoding pays on a 2-core CPU")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    p = CliParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="experiments/results/regime_map", help="path stem for .md/.json/.png")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads for every shape (default: as decoding "
                                                                "picks them, target.use_decode_threads)")
    p.add_argument("--frspec-k", type=int, default=32768, help="draft vocabulary of the larger shapes' drafters")
    p.add_argument("--bench", default="experiments/results/bench/bench.json",
                   help="bench.json whose Domino τ per set is projected onto every shape")
    p.add_argument("--draft-layers", type=int, default=2, help="backbone layers of the drafters (shipped: 2)")
    p.add_argument("--tree-nodes", type=int, default=32, help="node budget of the tree step timed against the "
                                                                "chain (0 = no tree)")
    p.add_argument("--tree", default="experiments/results/tree_n32/tree.json",
                   help="experiments/tree.py result whose Domino tree/chain τ gain per set is projected")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="targets' and drafters' dtype (real checkpoints ship in bfloat16; CPUs with bf16 matrix "
                        "units, e.g. AMX, run its matmuls at a different cost than float32's)")
    p.add_argument("--quick", action="store_true", help="two tiny shapes, 2 reps (tests)")
    a = p.parse_args(argv)
    stem = Path(a.out) if Path(a.out).is_absolute() else repo_root() / a.out
    check_out_file(stem.with_suffix(".json"))
    tree_nodes = trees.check_tree_nodes(a.tree_nodes, "--tree-nodes")
    shapes = QUICK if a.quick else SHAPES
    reps, rounds = (2, 1) if a.quick else (a.reps, a.rounds)
    res = {}
    for name, shape in shapes.items():
        target = build_target(shape, parse_dtype(a.dtype))
        use_decode_threads(target, a.threads)
        res[name] = measure(target, reps, rounds, 1024 if shape is None else a.frspec_k, a.draft_layers,
                            tree_nodes)
        print(f"{name}: {json.dumps({k: v for k, v in res[name].items() if k.endswith('_ms')})}", file=sys.stderr)
    meta = {"command": "python experiments/regime_map.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": f"{cpu_line()}; {cpu_matrix_units()}, torch {torch.__version__}, {a.dtype}",
            "date": time.strftime("%Y-%m-%d"),
            "tau_source": a.bench, "tree_source": a.tree, "draft_layers": a.draft_layers, "dtype": a.dtype}
    bench = Path(a.bench) if Path(a.bench).is_absolute() else repo_root() / a.bench
    measured = bench_results(bench)
    proj = projection(measured, res, ["domino"])         # the bench's formula: τ · t_step / (t_draft + t_verify)
    shipped = {s_: measured[s_]["domino"]["tau"] for s_ in proj}
    tree_path = Path(a.tree) if Path(a.tree).is_absolute() else repo_root() / a.tree
    gains = tree_gains(tree_path, tree_nodes) if tree_nodes else {}
    write_results(stem.parent, stem.name,              # (creates the folder the plot goes into)
                  {"meta": meta, "shipped_tau": shipped, "tree_tau_gain": gains, "results": res},
                  render(res, meta, shipped, proj, gains) + f"\n![bound vs τ]({stem.name}.png)\n")
    plot(res, stem.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    run_cli(main)
