"""Tree verification for block drafters: build a draft tree under a node budget, verify all of it in one target
forward, follow the longest path the target agrees with, and compact the target's cache to that path.

docs/design.md#tree-verification explains the method; in short:

- **Building** (`build_tree`): best-first by the drafter's path probability (the product of each node's probability
  given its parent), as DDTree does. A drafter supplies the children distribution of any node through an
  *expander* (`children(level, ids, tokens, parents, k)` -> the top-k children's log-probabilities, vocabulary ids
  and logits, one row per node, or one row shared by all): a DFlash drafter's children of every node at one depth
  are that slot's marginal; the Domino head runs its GRU along each branch, so its children depend on the path.
- **Verifying** (`attention_mask`, `positions`): the anchor and the N nodes go through the target in one forward;
  each node sees the cached prefix, the anchor and its own ancestors, at position anchor + depth.
- **Accepting** (`greedy_path`): from the anchor, step to the child whose token is the target's argmax while there
  is one; the target's argmax after the last accepted node is the bonus. Output equals plain greedy decoding.
  At T > 0 (`sampled_path`) each visited node tests its children in turn by speculative sampling with point-mass
  proposals (`sampling.accept_candidates`); the output is distributed exactly as the target's sampling.
- **Sampled trees** (`sample_tree`, T > 0): children drawn from the drafter without replacement, tested against
  the proposal they were drawn from by recursive rejection sampling (`sampling.accept_drawn`); also exact.
- **Compacting** (`compact_cache`): the K/V of the accepted nodes are moved next to the prefix and the rest cut.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import sampling
from ..errors import UserError

# A tree of N nodes scores up to N children per expanded node and verifies N + 1 tokens in one forward; beyond this
# the candidate tensors (N² per level) and the verify forward only cost memory, never acceptance anyone measured.
MAX_TREE_NODES = 1024


def check_tree_nodes(n, what: str = "tree_nodes") -> int:
    """A node budget as given by a user: a whole number 0..MAX_TREE_NODES (0 = chain verification)."""
    try:
        ok = not isinstance(n, bool) and int(n) == n and 0 <= int(n) <= MAX_TREE_NODES
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise UserError(f"{what} must be a whole number from 0 (chain verification) to {MAX_TREE_NODES}, got {n!r}")
    return int(n)


@dataclass
class Tree:
    """A draft tree. Nodes are ordered by depth, then by score, so a parent always precedes its children; in the
    verify forward row 0 is the anchor and row i + 1 is node i."""
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)    # parent node index, -1 = the anchor
    depths: list[int] = field(default_factory=list)     # 1 = a guess for the token right after the anchor
    scores: list[float] = field(default_factory=list)   # log-probability of the path from the anchor (drafter)
    # The drafter's top-k (vocabulary ids, logits) of the children of the anchor (key -1) and of every expanded
    # node: the "final" distributions the step record and the dashboard's inspector show.
    child_top: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)
    # A sampled tree (`sample_tree`) only: the distribution each expanded node's children were drawn from, keyed
    # like child_top: (vocabulary ids [K], probabilities [K]). Its children are listed in the order they were drawn.
    proposals: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tokens)

    def best_children(self) -> dict[int, int]:
        """{node: its best child} (-1 = the anchor), for nodes with children: nodes come in score order within a
        depth, so a node's best child is the first node naming it as parent."""
        first: dict[int, int] = {}
        for i, p in enumerate(self.parents):
            first.setdefault(p, i)
        return first

    def kids(self) -> list[dict[int, int]]:
        """Per verify row (0 = anchor, i + 1 = node i): {token: node index} of its children."""
        out: list[dict[int, int]] = [{} for _ in range(len(self) + 1)]
        for i, (t, p) in enumerate(zip(self.tokens, self.parents)):
            out[p + 1].setdefault(t, i)
        return out


def build_tree(expander, n_nodes: int, depth: int, topk: int = 5, min_logp: float = -math.inf) -> Tree:
    """The n_nodes most probable paths (prefix-closed) of at most `depth` drafts, built level by level; with
    `min_logp`, only paths whose log-probability is at least that (fewer nodes when the drafter is sure).

    Why level by level is exact: a child's score (its path's log-probability) is never above its parent's, so once
    n_nodes known nodes beat a node, neither it nor any descendant can make the final set and it is dropped for good.
    Each level scores the children of the kept nodes at the deepest depth (one batched expander call: the Domino
    head steps every kept branch at once) and keeps the best n_nodes of everything known. Every parent's children
    come sorted, so that selection is a merge of the sorted kept list with one sorted list per parent (a heap),
    O(n_nodes log parents) Python steps instead of sorting all parents × children. Ties keep the older node (a
    parent before its children), so the kept set is always a tree.
    """
    whole = getattr(expander, "best_first", None)      # the same tree in one call of the head's C++ loop
    built = whole(n_nodes, depth, max(n_nodes, topk), topk, min_logp) if whole is not None else None
    if built is not None:
        return _assemble(*built)
    toks: list[int] = []          # every node selected so far, by id (creation order: a parent precedes its children)
    pars: list[int] = []
    deps: list[int] = []
    scores: list[float] = []
    tops: dict[int, tuple[list[int], list[float]]] = {}
    kept: list[int] = []          # ids of the best n_nodes so far, best first
    frontier = [-1]               # -1 = the anchor
    for level in range(depth):
        args = (None, None) if level == 0 else ([toks[g] for g in frontier], [pars[g] for g in frontier])
        logp, ids, logits = (x.tolist() for x in expander.children(level, frontier, *args, max(n_nodes, topk)))
        shared = len(logp) == 1   # one row for every parent (DFlash: a slot's marginal ignores the path)
        for r, g in enumerate(frontier):
            tops[g] = (ids[0 if shared else r][:topk], logits[0 if shared else r][:topk])
        base = [scores[g] if g >= 0 else 0.0 for g in frontier]
        heap = [(-(base[r] + logp[0 if shared else r][0]), r, 0) for r in range(len(frontier))]
        heapq.heapify(heap)
        merged, i = [], 0
        while len(merged) < n_nodes and (i < len(kept) or heap):
            if i < len(kept) and (not heap or scores[kept[i]] >= -heap[0][0]):   # ties: the older node
                merged.append(kept[i])
                i += 1
                continue
            neg, r, j = heapq.heappop(heap)
            if -neg < min_logp:      # the best candidate left is below the floor, so is every other: none joins
                heap.clear()
                continue
            row = 0 if shared else r
            merged.append(len(toks))
            toks.append(ids[row][j])
            pars.append(frontier[r])
            deps.append(level + 1)
            scores.append(-neg)
            if j + 1 < len(logp[row]):
                heapq.heappush(heap, (-(base[r] + logp[row][j + 1]), r, j + 1))
        kept = merged
        frontier = [g for g in kept if deps[g] == level + 1]
        if not frontier:
            break
    return _assemble(toks, pars, deps, scores, kept, tops)


def _assemble(toks, pars, deps, scores, kept, tops) -> Tree:
    """The Tree of the kept nodes (ids into the creation-ordered toks / pars / deps / scores), ordered by depth,
    then score; `tops`: {expanded node id (-1 = the anchor): its children's top (ids, logits)}."""
    order = sorted(kept, key=lambda g: (deps[g], -scores[g], g))
    local = {g: i for i, g in enumerate(order)}
    tree = Tree([toks[g] for g in order], [local[pars[g]] if pars[g] >= 0 else -1 for g in order],
                [deps[g] for g in order], [scores[g] for g in order])
    tree.child_top = {(-1 if g == -1 else local[g]): v for g, v in tops.items() if g == -1 or g in local}
    return tree


def sample_tree(expander, n_nodes: int, depth: int, temperature: float, generator: torch.Generator | None = None,
                branching: int = 4, topk: int = 5) -> Tree:
    """A tree of at most n_nodes nodes and `depth` levels whose children are *drawn* from the drafter, for sampled
    decoding (T > 0): the anchor gets `branching` children, drawn without replacement from the drafter's
    distribution at temperature T (restricted to its top max(n_nodes, topk) tokens, which is the proposal the
    verifier is told); every later level gives one drawn child to each node of the level before, most probable
    path first, while the budget lasts.

    Exactness needs each node's children to be a draw from its proposal whose count is fixed before they are
    drawn: so a count may depend on the node's own path and its siblings (already drawn), never on the children
    themselves; keeping a drawn child because it scores well would bias the walk (docs/design.md#tree-verification).
    Draws without replacement are the Gumbel-top-k of the logits; their order is the drawing order."""
    toks: list[int] = []
    pars: list[int] = []
    scores: list[float] = []
    deps: list[int] = []
    tree = Tree()
    frontier, counts = [-1], [min(branching, n_nodes)]
    k = max(n_nodes, topk)
    for level in range(depth):
        args = (None, None) if level == 0 else ([toks[g] for g in frontier], [pars[g] for g in frontier])
        logp, ids, logits = expander.children(level, frontier, *args, k)
        shared = logp.shape[0] == 1
        keys = logits.double() / temperature
        q = torch.softmax(keys, -1)                 # per row (one for every node when the drafter shares it)
        drawn = []
        for r, (g, m) in enumerate(zip(frontier, counts)):
            row = 0 if shared else r
            tree.child_top[g] = (ids[row][:topk].tolist(), logits[row][:topk].tolist())
            tree.proposals[g] = (ids[row], q[row])
            base = scores[g] if g >= 0 else 0.0
            for j in sampling.draw_without_replacement(keys[row], m, generator):
                drawn.append(len(toks))
                toks.append(int(ids[row][j]))
                pars.append(g)
                deps.append(level + 1)
                scores.append(base + float(logp[row][j]))
        room = n_nodes - len(toks)
        frontier = sorted(drawn, key=lambda g: -scores[g])[:room]
        counts = [1] * len(frontier)
        if not frontier:
            break
    # nodes in creation order: by depth, and each parent's children in the order they were drawn
    tree.tokens, tree.parents, tree.depths, tree.scores = toks, pars, deps, scores
    return tree


def attention_mask(tree: Tree, prefix: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask [1, 1, 1 + N, prefix + 1 + N] for the verify forward over [anchor, nodes]: every row sees the
    cached prefix, the anchor and its own ancestors (itself included), nothing else.

    Additive (0 / dtype min) rather than boolean because Hugging Face's eager attention adds the mask to the scores
    while sdpa takes either kind; a 4D mask is passed through by HF unchanged."""
    n = len(tree) + 1
    # built in numpy, one row per node (a parent's row precedes its child's): per-depth torch indexing cost ~10x
    anc = np.zeros((n, n), dtype=bool)
    anc[0, 0] = True
    for i, p in enumerate(tree.parents, start=1):
        anc[i] = anc[p + 1]
        anc[i, i] = True
    mask = torch.zeros(1, 1, n, prefix + n, dtype=dtype)
    mask[0, 0, :, prefix:].masked_fill_(torch.from_numpy(~anc), torch.finfo(dtype).min)
    return mask.to(device)


def positions(tree: Tree, start: int, device) -> torch.Tensor:
    """Position ids [1, 1 + N]: the anchor at `start`, a node at depth k at start + k (siblings share one)."""
    return torch.tensor([[start] + [start + d for d in tree.depths]], device=device)


def greedy_path(tree: Tree, next_token) -> tuple[list[int], int]:
    """next_token(row): the target's argmax at a verify row (0 = anchor, i + 1 = node i). Returns (the accepted node
    indices, anchor side first; the bonus: the target's argmax after the last accepted node). Only the rows on the
    walk are asked for, so the caller can compute the LM head for them alone. The target's greedy continuation is
    unique, so at most one child matches at each step and the path is the longest one the target agrees with."""
    kids = tree.kids()
    path, row = [], 0
    while (child := kids[row].get(tok := next_token(row))) is not None:
        path.append(child)
        row = child + 1
    return path, tok


def sampled_path(tree: Tree, probs, generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """The walk at T > 0. probs(row): the target's warped distribution [V] at a verify row. From the anchor, the
    children of the current row are tested in node order: a best-first tree's as fixed candidates
    (`sampling.accept_candidates`), a sampled tree's against the proposal they were drawn from
    (`sampling.accept_drawn`). An accepted child is stepped to, and when every child is rejected (or the row has
    none) the token drawn from the residual is the bonus. Each accepted node's distribution was computed on its true
    prefix, so every token the walk emits is distributed as the target's next-token distribution given the tokens
    before it."""
    kids = tree.kids()
    path, row = [], 0
    while True:
        cands = list(kids[row])                     # tokens of the row's children, in node order
        drawn = tree.proposals.get(row - 1)
        if drawn is not None and cands:             # a sampled tree: the children were drawn from this proposal
            p = probs(row)
            q = torch.zeros_like(p)
            q[drawn[0].to(p.device)] = drawn[1].to(p.dtype).to(p.device)
            j, tok = sampling.accept_drawn(cands, q, p, generator)
        else:                                       # fixed candidates (best-first), or a leaf
            j, tok = sampling.accept_candidates(cands, probs(row), generator)
        if j is None:
            return path, tok
        path.append(kids[row][tok])
        row = path[-1] + 1


def likely_rows(tree: Tree, node: int = -1) -> list[int]:
    """The verify rows of `node` (-1 = the anchor) and of its line of best children: the path the walk takes if the
    target agrees with the drafter's first choice at every depth. The engine runs the LM head on these rows in one
    call: on a small target one row costs most of what nine do (the head's weights are read once either way)."""
    first = tree.best_children()
    rows = [node + 1]
    while (node := first.get(node)) is not None:
        rows.append(node + 1)
    return rows


def reported_path(tree: Tree, path: list[int]) -> list[int]:
    """The nodes a step record lists as its drafts: the accepted ones, then the tree's best child of the last of them
    (the first rejected guess), if it has one. Later nodes were conditioned on a rejected token, as the tail of a
    rejected chain is; listing the first rejection keeps per-position acceptance meaning "reached and accepted"."""
    best = tree.best_children().get(path[-1] if path else -1)
    return list(path) + ([best] if best is not None else [])


def compact_cache(cache, prefix: int, rows: list[int]) -> None:
    """Keep the prefix and the given verify rows (0 = anchor, i + 1 = node i; ascending) of every layer.

    Gathering the accepted rows costs a few microseconds per layer; the alternative, cropping to the anchor and
    running the accepted drafts through the target again, costs a whole forward."""
    from transformers.cache_utils import DummyLayer, DynamicLayer

    from .kv_cache import GrowingLayer, WindowLayer

    keep = len(rows)
    contiguous = rows == list(range(keep))
    for layer in cache.layers:
        if type(layer) is DummyLayer:                     # (a layer without a cache: MLP only)
            continue
        # per-token state (linear attention): gathering rows is not enough (callers refuse such targets up front)
        if type(layer) not in (DynamicLayer, GrowingLayer, WindowLayer):
            raise UserError("tree verification needs a target whose cache layers are plain (no linear attention or "
                            "other per-token state); decode this target without a drafter")
        if not layer.is_initialized:
            continue
        # a window layer holds the positions from its offset on: the prefix is shorter there by as many columns
        first = prefix - layer.offset if type(layer) is WindowLayer else prefix
        if not contiguous:
            idx = torch.tensor(rows, device=layer.keys.device) + first
            layer.keys[..., first: first + keep, :] = layer.keys[..., idx, :]
            layer.values[..., first: first + keep, :] = layer.values[..., idx, :]
        if type(layer) is WindowLayer:
            layer.crop(first + keep - layer.keys.shape[-2])     # (its crop keeps its own bookkeeping)
        else:
            layer.keys = layer.keys[..., : first + keep, :]
            layer.values = layer.values[..., : first + keep, :]
