"""Tree verification (decoding/tree.py): the tree, its mask and positions, cache compaction, the greedy walk, and
greedy losslessness end to end for the block drafters, through the engine and every CLI that offers --tree-nodes."""
from __future__ import annotations

import itertools
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from domino_lab import Drafter, Target, speculative_generate
from domino_lab.decoding import tree as trees
from domino_lab.errors import UserError, run_cli
from domino_lab.models import load_drafter
from domino_lab.models.options import InferenceOptions
from core_helpers import make_target_dir, tiny_target

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------- building
class PathExpander:
    """Children distributions that depend on the whole path (like the Domino head), from a seeded hash of it."""

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab, self.seed, self.paths = vocab, seed, {-1: ()}

    def logits(self, path: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((self.seed,) + path) % (1 << 31))
        return torch.randn(self.vocab, generator=g, dtype=torch.float64) * 2

    def children(self, level, ids, tokens, parents, k):
        from domino_lab.sampling import top_children

        if level:
            for g, t, p in zip(ids, tokens, parents):
                self.paths[g] = self.paths[p] + (t,)
        return top_children(torch.stack([self.logits(self.paths[g]) for g in ids]), k)


def brute_force(exp: PathExpander, n: int, depth: int) -> set[tuple[int, ...]]:
    """The n most probable paths of every length 1..depth, by enumerating them all."""
    scored = []
    for d in range(1, depth + 1):
        for path in itertools.product(range(exp.vocab), repeat=d):
            lp = sum(float(torch.log_softmax(exp.logits(path[:i]), -1)[path[i]]) for i in range(d))
            scored.append((lp, path))
    scored.sort(reverse=True)
    return {p for _, p in scored[:n]}


def paths_of(tree: trees.Tree) -> set[tuple[int, ...]]:
    out = []
    for i in range(len(tree)):
        p, j = [], i
        while j >= 0:
            p.append(tree.tokens[j])
            j = tree.parents[j]
        out.append(tuple(reversed(p)))
    return set(out)


@pytest.mark.parametrize("n,depth,seed", [(1, 3, 0), (5, 3, 1), (12, 3, 2), (30, 4, 3), (200, 2, 4)])
def test_build_tree_is_the_best_n_paths(n, depth, seed):
    exp = PathExpander(vocab=4, seed=seed)
    tree = trees.build_tree(exp, n, depth)
    assert paths_of(tree) == brute_force(PathExpander(vocab=4, seed=seed), n, depth)
    assert len(tree) == min(n, sum(4 ** d for d in range(1, depth + 1)))
    for i, p in enumerate(tree.parents):          # parents first, depths consistent, scores never rise
        assert p < i and tree.depths[i] == (tree.depths[p] + 1 if p >= 0 else 1)
        assert p < 0 or tree.scores[i] <= tree.scores[p]


# ---------------------------------------------------------------------------------------------- mask, positions
# anchor ─ a(0) ─ c(2) ─ e(4)
#        └ b(1) ─ d(3)
#               └ f(5)
TREE = trees.Tree(tokens=[10, 11, 12, 13, 14, 15], parents=[-1, -1, 0, 1, 2, 1], depths=[1, 1, 2, 2, 3, 2],
                  scores=[0.0] * 6)


def test_mask_rows_see_prefix_anchor_and_ancestors_only():
    m = trees.attention_mask(TREE, prefix=3, dtype=torch.float32, device="cpu")[0, 0]
    assert m.shape == (7, 10)
    seen = m == 0
    assert seen[:, :3].all()                                   # the cached prefix: every row
    ancestors = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 2, 4}, 5: {0, 1, 3, 5}, 6: {0, 2, 6}}
    for row, anc in ancestors.items():
        assert {c for c in range(7) if seen[row, 3 + c]} == anc, row
    assert (m[~seen] == torch.finfo(torch.float32).min).all()
    assert trees.positions(TREE, 3, "cpu").tolist() == [[3, 4, 4, 5, 5, 6, 5]]


def test_tree_forward_equals_a_causal_forward_of_each_path(target):
    """The verify forward's logits at every node equal the target's on prefix + that node's path alone: the mask
    and the positions are right."""
    prefix = [5, 9, 17, 4]
    cache = DynamicCache(config=target.model.config)
    target.forward(torch.tensor([prefix[:-1]]), cache=cache)
    anchor = prefix[-1]
    t = trees.Tree(tokens=[20, 21, 22, 23, 24], parents=[-1, -1, 0, 0, 3], depths=[1, 1, 2, 2, 3], scores=[0.0] * 5)
    start = len(prefix) - 1
    out = target.forward(torch.tensor([[anchor] + t.tokens]), cache=cache,
                         attention_mask=trees.attention_mask(t, start, target.dtype, "cpu"),
                         position_ids=trees.positions(t, start, "cpu"))
    for i in range(len(t)):
        path, j = [], i
        while j >= 0:
            path.insert(0, t.tokens[j])
            j = t.parents[j]
        ref = target.forward(torch.tensor([prefix + path])).logits[0, -1]
        torch.testing.assert_close(out.logits[0, i + 1], ref, rtol=1e-9, atol=1e-9)


def test_compact_cache_keeps_prefix_and_accepted_rows_in_order():
    cache = DynamicCache()
    k = torch.arange(2 * 12, dtype=torch.float64).view(1, 2, 12, 1).repeat(1, 1, 1, 3)
    for layer in range(2):
        cache.update(k + 100 * layer, -(k + 100 * layer), layer)
    trees.compact_cache(cache, prefix=5, rows=[0, 2, 6])          # anchor at 5, nodes at 7 and 11
    for layer in range(2):
        keys, values = cache.layers[layer].keys, cache.layers[layer].values
        want = [0, 1, 2, 3, 4, 5, 7, 11]
        assert keys.shape[-2] == 8 and cache.get_seq_length() == 8
        assert keys[0, 0, :, 0].tolist() == [w + 100 * layer for w in want]
        assert keys[0, 1, :, 0].tolist() == [12 + w + 100 * layer for w in want]
        assert torch.equal(values, -keys)
    trees.compact_cache(cache, prefix=6, rows=[0, 1])              # contiguous: a plain crop
    assert cache.get_seq_length() == 8


def test_greedy_path_follows_the_target_and_returns_its_bonus():
    # target argmax per verify row (0 = anchor, i + 1 = node i)
    best = {0: 11, 2: 13, 4: 99, 1: 12}
    asked = []

    def next_token(row):
        asked.append(row)
        return best[row]
    path, bonus = trees.greedy_path(TREE, next_token)
    assert path == [1, 3] and bonus == 99 and asked == [0, 2, 4]   # only the walked rows were scored
    assert trees.greedy_path(TREE, lambda row: 7) == ([], 7)
    assert trees.reported_path(TREE, [1, 3]) == [1, 3]             # d has no children
    assert trees.reported_path(TREE, [1]) == [1, 3]                # b's best child
    assert trees.reported_path(TREE, []) == [0]


def test_likely_rows_follow_each_nodes_best_child():
    # the rows whose LM head the verify computes in one call: the anchor's line of best children, then the line
    # below a node where the walk leaves it
    assert trees.likely_rows(TREE) == [0, 1, 3, 5]                # anchor, a, c, e
    assert trees.likely_rows(TREE, 1) == [2, 4]                   # b, then d (b's first child in score order)
    assert trees.likely_rows(TREE, 4) == [5]                      # a leaf: its own row only
    assert trees.likely_rows(trees.Tree()) == [0]


# ---------------------------------------------------------------------------------------------- the Domino branches
@pytest.mark.parametrize("impl", ["fast", "fused"])
def test_domino_branch_along_the_chain_has_the_chains_logits(target, impl):
    from domino_lab.models.domino_head import greedy_rollout

    d = Drafter.untrained(target, "domino", seed=3, block_size=6)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, 6, d.config.hidden_size, generator=g, dtype=torch.float64)
    base = d.lm_head(h)
    anchor = torch.tensor([7])
    E = target.embed_tokens.weight
    for pool in (0, 16):
        table, w_s, w1_h = d.head.fast_weights(E)
        tokens, logits, cols = greedy_rollout(table, w_s, w1_h, d.head.w2.weight, h, base, anchor, pool)
        br = d.head.branches(h, base, anchor, E, pool, impl=impl)
        assert (br.fw is not None) == (impl == "fused")
        for level in range(6):     # the node at depth `level` has id level - 1 (-1: the anchor)
            args = (None, None) if level == 0 else ([tokens[0, level - 1].item()], [level - 2])
            _, ids, top = br.children(level, [level - 1], *args, k=3)
            assert ids[0, 0] == tokens[0, level]
            want = logits[0, level].topk(3).values if level else base[0, 0].topk(3).values
            torch.testing.assert_close(top[0], want.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_branches_score_what_the_torch_branches_score(target, dtype):
    """The C++ level (head_kernel.cpp: branch_level) against the torch ops, level by level on the same random
    tree: each node's state reads its own token into its parent's, its children are ranked alike (full vocabulary,
    a pool, FR-Spec), and parents shared by several nodes are handled once each."""
    tol = 1e-5                      # the torch path ranks children in float32 (sampling.top_children)
    target = target if dtype == torch.float64 else tiny_target(vocab=100, hidden=32, dtype=dtype)
    d = Drafter.untrained(target, "domino", seed=4, block_size=6)
    E = target.embed_tokens.weight
    g = torch.Generator().manual_seed(1)
    h = torch.randn(1, 6, d.config.hidden_size, generator=g, dtype=dtype)
    anchor = torch.tensor([9])
    frspec = torch.sort(torch.randperm(target.vocab_size, generator=g)[:40]).values
    for vocab_ids, pool in ((None, 0), (None, 16), (frspec, 0), (frspec, 8)):
        base = d.lm_head(h) if vocab_ids is None else d.lm_head(h)[..., vocab_ids]
        fast = d.head.branches(h, base, anchor, E, pool, vocab_ids, impl="fast")
        fused = d.head.branches(h, base, anchor, E, pool, vocab_ids, impl="fused")
        assert fused.fw is not None and fast.fw is None
        torch.testing.assert_close(fused.states, fast.states, rtol=tol, atol=tol)
        nodes, next_id = [-1], 0
        for level in range(5):
            if level:     # every node of the last level gets 1-3 children, some parents several
                parents = [p for p in nodes for _ in range(1 + (p + level) % 3)]
                tokens = torch.randint(0, target.vocab_size, (len(parents),), generator=g).tolist()
                ids = list(range(next_id, next_id + len(parents)))
                next_id += len(parents)
            else:
                parents = tokens = None
                ids = [-1]
            a = fast.children(level, ids, tokens, parents, 5)
            b = fused.children(level, ids, tokens, parents, 5)
            assert torch.equal(a[1], b[1]), (vocab_ids is not None, pool, level)
            torch.testing.assert_close(b[0].float(), a[0].float(), rtol=tol, atol=tol)
            torch.testing.assert_close(b[2].float(), a[2].float(), rtol=tol, atol=tol)
            if level:
                torch.testing.assert_close(fused.states, fast.states, rtol=tol, atol=tol)
            nodes = ids


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_whole_tree_in_one_call_is_the_level_by_level_tree(target, dtype):
    """head_kernel.cpp's best_first (every level and the selection between them in one call) builds the tree that
    build_tree builds from the same Branches one level at a time: the same nodes in the same order, scores equal to
    the last bit, the same records of each node's children; under budgets from 1 node to more than a level holds,
    probability floors, a pool and FR-Spec."""
    class LevelByLevel:                 # the expander without its one-call path
        def __init__(self, e):
            self.children = e.children

    target = target if dtype == torch.float64 else tiny_target(vocab=100, hidden=32, dtype=dtype)
    d = Drafter.untrained(target, "domino", seed=5, block_size=6)
    E = target.embed_tokens.weight
    g = torch.Generator().manual_seed(2)
    frspec = torch.sort(torch.randperm(target.vocab_size, generator=g)[:40]).values
    sizes = set()
    for trial in range(6):
        h = torch.randn(1, 6, d.config.hidden_size, generator=g, dtype=dtype) * (1 + trial)
        anchor = torch.randint(0, target.vocab_size, (1,), generator=g)
        for vocab_ids, pool in ((None, 0), (None, 16), (frspec, 8)):
            base = d.lm_head(h) if vocab_ids is None else d.lm_head(h)[..., vocab_ids]
            for n, floor in ((1, -math.inf), (7, -math.inf), (32, -math.inf), (32, math.log(0.05)), (64, -3.0)):
                br = d.head.branches(h, base, anchor, E, pool, vocab_ids, impl="fused")
                assert br.best_first(n, 5, max(n, 4), 4, floor) is not None
                a = trees.build_tree(br, n, 5, 4, floor)
                b = trees.build_tree(LevelByLevel(d.head.branches(h, base, anchor, E, pool, vocab_ids,
                                                                    impl="fused")), n, 5, 4, floor)
                assert (a.tokens, a.parents, a.depths, a.scores) == (b.tokens, b.parents, b.depths, b.scores)
                assert a.child_top == b.child_top
                sizes.add(len(a))
    assert len(sizes) > 4                       # budgets and floors shaped trees of many sizes


def test_fused_branch_level_refuses_ids_out_of_range(target):
    from domino_lab.models.head_kernel import fused_branch_level

    d = Drafter.untrained(target, "domino", seed=4, block_size=6)
    fw = d.head.fused_weights(target.embed_tokens.weight)
    prev = torch.zeros(2, d.config.gru_hidden)
    for parent, token in (([0], [target.vocab_size]), ([2], [3]), ([-2], [3])):
        with pytest.raises(IndexError):
            fused_branch_level(fw, prev, torch.tensor(parent), torch.tensor(token), None, None, None, 0)


# ---------------------------------------------------------------------------------------------- losslessness
PROMPTS = [[5, 9, 17, 4], [3], [11, 11, 11, 11, 11, 11], [60, 2, 33, 7, 1, 40, 8]]


@pytest.mark.parametrize("method,shift", [("dflash", True), ("domino", True), ("domino", False)])
def test_untrained_block_drafters_are_lossless_on_the_tiny_target(target, method, shift):
    d = Drafter.untrained(target, method, seed=2, block_size=5, shift_label=shift)
    for p in PROMPTS:
        plain = speculative_generate(target, None, prompt_ids=p, max_new_tokens=14).token_ids
        for n, p_min in ((1, 0), (8, 0), (32, 0), (64, 0), (32, 0.01), (32, 0.3)):
            d.set_options(InferenceOptions(tree_min_prob=p_min))
            res = speculative_generate(target, d, prompt_ids=p, max_new_tokens=14, tree_nodes=n)
            assert res.token_ids == plain, (method, shift, n, p_min, p)
            assert res.target_forward_calls == len(res.steps) + 1
            if p_min == 0.3:      # at most 3 paths can each hold 30% of the probability; siblings share it
                assert all(sum(q == -1 for q in s.tree_parents) <= 3 for s in res.steps)


@pytest.fixture(scope="module")
def default_target():
    return Target.from_pretrained("default")


DEFAULT_PROMPTS = ["def fibonacci(n):\n    ", "Tom has 3 boxes with 12 pencils each. He gives away 7. How many",
                   "  \n\t#### 42 }{ ))"]       # code, math, and an odd one


@pytest.mark.parametrize("spec", ["default", "default-dflash"])
def test_shipped_drafters_are_lossless_and_trees_accept_more(default_target, spec):
    d = load_drafter(spec, default_target)
    tau = {}
    for prompt in DEFAULT_PROMPTS:
        plain = speculative_generate(default_target, None, prompt=prompt, max_new_tokens=16).token_ids
        for n in (0, 1, 8, 32, 64):
            res = speculative_generate(default_target, d, prompt=prompt, max_new_tokens=16, tree_nodes=n)
            assert res.token_ids == plain, (spec, n, prompt)
            tau.setdefault(n, []).extend(res.acceptance_lengths)
    mean = {n: sum(v) / len(v) for n, v in tau.items()}
    assert mean[64] > mean[0] and mean[32] > mean[0]      # a 32-node tree keeps more than the chain


def test_budget_eos_and_records(target):
    d = Drafter.untrained(target, "domino", seed=5, block_size=6)
    for budget in (1, 2, 5):
        res = speculative_generate(target, d, prompt_ids=[5, 9], max_new_tokens=budget, tree_nodes=16)
        assert res.token_ids == speculative_generate(target, None, prompt_ids=[5, 9], max_new_tokens=budget).token_ids
        assert len(res.token_ids) <= budget
    res = speculative_generate(target, d, prompt_ids=[60, 2, 33], max_new_tokens=30, tree_nodes=16, topk=5)
    for s in res.steps:
        assert s.tree_tokens is not None and len(s.tree_parents) == len(s.tree_tokens) <= 16
        assert [s.tree_tokens[i] for i in s.tree_path] == s.draft_tokens[: s.accepted] == s.committed[: s.accepted]
        assert all(p < i for i, p in enumerate(s.tree_parents))
        assert len(s.target_topk_ids) == s.accepted + 1 and len(s.draft_tokens) in (s.accepted, s.accepted + 1)
        assert len(s.base_topk_ids) == len(s.final_topk_ids) == len(s.draft_tokens)
    json.dumps(res.to_dict(steps=True))
    # records keep top-k only when asked; the decode itself is the same either way
    lean = speculative_generate(target, d, prompt_ids=[60, 2, 33], max_new_tokens=30, tree_nodes=16)
    assert lean.token_ids == res.token_ids
    assert [(s.tree_tokens, s.tree_path) for s in lean.steps] == [(s.tree_tokens, s.tree_path) for s in res.steps]
    assert not any(s.target_topk_ids or s.base_topk_ids or s.final_topk_ids for s in lean.steps)
    chain = speculative_generate(target, d, prompt_ids=[60, 2, 33], max_new_tokens=8)
    assert all(s.tree_tokens is None and s.tree_path is None for s in chain.steps)   # chain records unchanged


def test_refusals_are_one_clear_error(target):
    d = Drafter.untrained(target, "dflash", seed=0)
    with pytest.raises(UserError, match="block drafter"):
        speculative_generate(target, Drafter.untrained(target, "eagle", seed=0), prompt_ids=[5], max_new_tokens=4,
                             tree_nodes=8)
    with pytest.raises(UserError, match="needs a drafter"):
        speculative_generate(target, None, prompt_ids=[5], max_new_tokens=4, tree_nodes=8)
    for bad in (-1, 1.5, "x", trees.MAX_TREE_NODES + 1):
        with pytest.raises(UserError, match="tree_nodes"):
            speculative_generate(target, d, prompt_ids=[5], max_new_tokens=4, tree_nodes=bad)
    # T > 0 without a tree still runs speculative sampling over the chain
    res = speculative_generate(target, d, prompt_ids=[5], max_new_tokens=4, temperature=0.7, seed=1)
    assert res.token_ids and all(s.tree_tokens is None for s in res.steps)


@pytest.mark.parametrize("method, sampled", [("dflash", False), ("domino", False), ("dflash", True), ("domino", True)])
def test_sampled_tree_decoding_is_seeded_and_records_its_walk(target, method, sampled):
    """T > 0 with a tree: the same seed gives the same text; every step's accepted path is a path of its tree whose
    tokens are the step's committed tokens (the distribution itself: tests/test_sampling.py). A sampled tree has
    at most 4 children at the anchor and one below every other node."""
    d = Drafter.untrained(target, method, seed=0).set_options(InferenceOptions(tree_sampled=sampled))
    runs = [speculative_generate(target, d, prompt_ids=[60, 2, 33], max_new_tokens=40, temperature=0.9, top_p=0.95,
                                 seed=s, tree_nodes=16) for s in (3, 3, 4)]
    assert runs[0].token_ids == runs[1].token_ids and len(runs[0].steps) > 3
    assert runs[0].token_ids != runs[2].token_ids
    for s in runs[0].steps:
        assert s.tree_tokens is not None and len(s.tree_tokens) <= 16
        row = -1
        for node in s.tree_path:                    # each accepted node's parent is the previous one
            assert s.tree_parents[node] == row
            row = node
        assert [s.tree_tokens[i] for i in s.tree_path] == s.committed[: s.accepted]
        if sampled:
            kids = [s.tree_parents.count(i) for i in range(-1, len(s.tree_tokens))]
            assert kids[0] == min(4, len(s.tree_tokens)) and max(kids[1:], default=0) <= 1
    if sampled:                 # a floor would drop drawn children: refused
        with pytest.raises(UserError, match="tree min prob"):
            speculative_generate(target, Drafter.untrained(target, method, seed=0).set_options(
                InferenceOptions(tree_sampled=True, tree_min_prob=0.1)), prompt_ids=[5], max_new_tokens=4,
                temperature=0.5, tree_nodes=8)


# ---------------------------------------------------------------------------------------------- CLIs, app, experiment
@pytest.fixture(scope="module")
def tdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree")
    tdir = make_target_dir(root / "target", max_pos=128)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n"
                               for i, p in enumerate(["def add(a, b):", "Question: Tom has 3 apples"])))
    return root, str(tdir), str(prompts)


def _cli(main, argv, capsys):
    with pytest.raises(SystemExit) as e:
        run_cli(main, argv)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_generate_cli_tree_flag(tdir, capsys):
    from domino_lab.generate import main

    _, t, _ = tdir
    common = ["--target", t, "--prompt", "def add(a, b):", "--max-new-tokens", "16", "--dtype", "float64", "--json"]
    outs = {}
    for drafter, n in (("none", "0"), ("untrained:domino", "8"), ("untrained:dflash", "32")):
        code, out, err = _cli(main, common + ["--drafter", drafter, "--tree-nodes", n, "--steps"], capsys)
        assert code == 0, err
        outs[drafter] = json.loads(out)
    assert outs["none"]["token_ids"] == outs["untrained:domino"]["token_ids"] == outs["untrained:dflash"]["token_ids"]
    assert all(s["tree_tokens"] is not None for s in outs["untrained:domino"]["steps"])
    code, out, err = _cli(main, common + ["--drafter", "untrained:domino", "--tree-nodes", "8", "--temperature", "0.5",
                                          "--seed", "2"], capsys)
    assert code == 0 and len(json.loads(out)["token_ids"]) == 16, err
    code, out, err = _cli(main, common + ["--drafter", "untrained:dflash", "--tree-nodes", "8", "--temperature", "0.5",
                                          "--tree-sampled", "--steps"], capsys)
    steps = json.loads(out)["steps"]
    assert code == 0 and max(s["tree_parents"].count(-1) for s in steps) == 4, err      # 4 drawn at the anchor
    for extra, msg in ((["--drafter", "untrained:domino", "--tree-nodes", "8", "--temperature", "0.5", "--tree-sampled",
                         "--tree-min-prob", "0.1"], "tree min prob"),
                       (["--drafter", "untrained:eagle", "--tree-nodes", "8"], "block drafter"),
                       (["--drafter", "untrained:domino", "--tree-nodes", "-2"], "--tree-nodes")):
        code, out, err = _cli(main, common + extra, capsys)
        lines = [x for x in err.splitlines() if x.startswith("error:")]
        assert code == 2 and len(lines) == 1 and msg in lines[0] and not out, err


def test_inference_and_bench_tree_paths(tdir, tmp_path, capsys):
    from domino_lab.bench import main as bench_main
    from domino_lab.inference import predict

    root, t, prompts = tdir
    target = Target.from_pretrained(t, dtype="float64")
    d = Drafter.untrained(target, "domino", seed=1)
    rows = predict(target, d, prompts, max_new_tokens=12, accelerator="cpu", devices=1, tree_nodes=8)
    for r, text in zip(rows, ["def add(a, b):", "Question: Tom has 3 apples"]):
        assert r["token_ids"] == speculative_generate(target, None, prompt=text, max_new_tokens=12).token_ids
        assert r["steps"][0]["tree_tokens"] is not None
    sampled = predict(target, d, prompts, max_new_tokens=6, accelerator="cpu", devices=1, temperature=0.5,
                      tree_nodes=8)
    assert [len(r["token_ids"]) for r in sampled] == [6, 6] and sampled[0]["steps"][0]["tree_tokens"] is not None

    for m in ("domino", "dflash"):
        Drafter.untrained(target, m, seed=1).save_pretrained(root / m)
    out = tmp_path / "bench"
    argv = ["--target", t, "--dtype", "float64", "--sets", prompts, "--quick", "--out", str(out), "--methods", "ar",
            "dflash", "dflash-tree", "domino-tree", "--domino", str(root / "domino"), "--dflash", str(root / "dflash"),
            "--tree-nodes", "16"]
    assert bench_main(argv) == 0
    data = json.loads((out / "bench.json").read_text())
    res = data["results"]["prompts"]
    assert data["meta"]["tree_nodes"] == 16
    for m in ("dflash", "dflash-tree", "domino-tree"):
        assert res[m]["lossless"]["equal"] == res[m]["lossless"]["total"] == 2 and res[m]["tau"] >= 1
    code, _, err = _cli(bench_main, argv[:-1] + ["0"], capsys)
    assert code == 2 and "--tree-nodes" in err


def test_dashboard_tree_view(default_target):
    from app.decode import Request, Snapshot, Texts, tree_html

    res = speculative_generate(default_target, load_drafter("default", default_target),
                               prompt="def fibonacci(n):\n", max_new_tokens=16, tree_nodes=16)
    html = tree_html(Snapshot("default", steps=res.steps), Texts(default_target)).split("</div>", 1)[1]  # no legend
    n_acc = sum(s.accepted for s in res.steps)
    n_bonus = sum(s.bonus is not None for s in res.steps)
    assert html.count('class="tile acc"') == n_acc and html.count('class="tile bonus"') == n_bonus
    assert html.count('class="tile rej"') == sum(len(s.tree_tokens) for s in res.steps) - n_acc
    assert html.count('class="tstep"') == len(res.steps)
    assert "no tree steps" in tree_html(None, None)
    assert Request("x", "default", "default", tree_nodes="8").checked().tree_nodes == 8
    with pytest.raises(UserError, match="tree nodes"):
        Request("x", "default", "default", tree_nodes=10_000).checked()
    assert Request("x", "default", "default", tree_min_prob="0.05").checked().tree_min_prob == 0.05
    for bad in (1.0, -0.1, "abc"):
        with pytest.raises(UserError, match="tree min prob"):
            Request("x", "default", "default", tree_min_prob=bad).checked()


def test_tree_experiment_smoke(tmp_path):
    sys.path.insert(0, str(ROOT / "experiments"))
    import tree as experiment

    with pytest.raises(UserError, match="--nodes"):
        experiment.parse_args(["--nodes", "0"])
    with pytest.raises(UserError, match="tree min prob"):
        experiment.parse_args(["--drafter", "d=default@tree_min_prob=2"])
    assert experiment.main(["--quick", "--limit", "1", "--sets", "math", "--nodes", "4", "--max-new-tokens", "6",
                            "--drafter", "dflash=default-dflash", "--drafter", "sure=default-dflash@tree_min_prob=0.5",
                            "--warmup", "0", "--dtype", "float64", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "tree.json").read_text())
    assert data["meta"]["dtype"] == "float64"
    rows = data["summary"]["math"]
    assert set(rows) == {"dflash@0", "dflash@4", "sure@0", "sure@4"}
    assert all(r["lossless"] == r["prompts"] == 1 for r in rows.values())
    assert (tmp_path / "tree.png").exists() and "| math | dflash | 4 |" in (tmp_path / "tree.md").read_text()
    assert not math.isnan(rows["dflash@4"]["tau"][0])
    # the first two families are compared prompt by prompt at every N: the same decodes, so Δτ is exactly 0
    cmp = data["compare"]
    assert cmp["families"] == ["dflash", "sure"] and set(cmp["by_set"]["math"]) == {"0", "4"}
    assert cmp["by_set"]["math"]["0"]["mean_diff"] == 0 and cmp["by_set"]["math"]["0"]["n"] == 1
    assert "Per-prompt τ(dflash) − τ(sure)" in (tmp_path / "tree.md").read_text()
    with pytest.raises(UserError, match="--compare"):
        experiment.parse_args(["--drafter", "a=default", "--compare", "a", "b"])
    with pytest.raises(UserError, match="--temperature"):
        experiment.parse_args(["--temperature", "-1"])
    # sampled: two rounds are two samples of the prompt, pooled into τ; no token-for-token check
    out = tmp_path / "t1"
    assert experiment.main(["--limit", "1", "--sets", "math", "--nodes", "4", "--max-new-tokens", "8", "--rounds", "2",
                            "--drafter", "dflash=default-dflash", "--warmup", "0", "--temperature", "1",
                            "--out", str(out)]) == 0
    data = json.loads((out / "tree.json").read_text())
    row = data["results"]["math"]["dflash@4"]
    assert data["meta"]["temperature"] == 1.0 and row["lossless"] is None and len(row["tokens_per_s_rounds"]) == 2
    assert row["per_prompt"][0]["steps"] >= 2 and row["tau"] > 0
    assert "| math | dflash | 4 | 1 |" in (out / "tree.md").read_text() and "sampled |" in (out / "tree.md").read_text()
    # the gumbel sampler: the seed fixes the text, so every configuration is checked against ar again
    out = tmp_path / "g1"
    assert experiment.main(["--limit", "1", "--sets", "math", "--nodes", "4", "--max-new-tokens", "8", "--rounds", "2",
                            "--drafter", "domino=default", "--warmup", "0", "--temperature", "1", "--sampler", "gumbel",
                            "--out", str(out)]) == 0
    data = json.loads((out / "tree.json").read_text())
    assert data["meta"]["sampler"] == "gumbel"
    assert all(r["lossless"] == r["prompts"] == 1 for r in data["results"]["math"].values())
    assert "gumbel sampler" in (out / "tree.md").read_text()


def test_min_path_probability_keeps_the_likely_subtree():
    """A floor on the path log-probability keeps exactly the nodes of the unfloored tree that reach it (the set
    stays a tree, in the same order); a floor above every path leaves no tree at all."""
    for seed in range(4):
        full = trees.build_tree(PathExpander(12, seed), 24, 5)
        floor = sorted(full.scores)[len(full) // 2]
        cut = trees.build_tree(PathExpander(12, seed), 24, 5, min_logp=floor)
        keep = [i for i, sc in enumerate(full.scores) if sc >= floor]
        assert cut.tokens == [full.tokens[i] for i in keep] and cut.scores == [full.scores[i] for i in keep]
        assert all(p < i for i, p in enumerate(cut.parents))
        assert len(trees.build_tree(PathExpander(12, seed), 24, 5, min_logp=0.5)) == 0
