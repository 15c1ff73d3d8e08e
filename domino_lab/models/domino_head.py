"""The Domino head: a GRU over the drafted prefix plus a low-rank correction in logit space.

S_i = GRU(E(x_anchor), E(d_1), ..., E(d_i)) with a zero state per block, over the target's frozen
embeddings; dL_i = W2 . SiLU(W1 . [H_i ; S_i]); L_i = L_base_i + dL_i; the first draft is uncorrected, as in the
paper, unless `correct_first` (then dL_0 reads H_0 and S_0 = GRU(E(x_anchor)): docs/design.md#correcting-the-first-draft).
Correcting logits (not hidden states) avoids a full LM-head pass per sequential step.

Inference paths, all in this module (docs/design.md#inference-paths-of-the-head):
- `eager`: nn.GRU and the correction over the full vocabulary, one module call per step (the reference the others
  are checked against);
- `fast`: the GRU input projection of every vocabulary row precomputed (a V x 3g table, so a step's input is a
  row gather), W1_H . H_i for all slots in one matmul before the loop, the GRU cell written out, and the
  correction scored only on a candidate pool (top-K of the per-token max base logit over the block's slots;
  K = 0 scores the full vocabulary and gives the eager drafts);
- `compiled`: the fast greedy rollout as one `torch.compile`d graph (no per-step Python or allocation; CUDA graphs
  on CUDA via mode="reduce-overhead"); falls back to `fast` with a warning where compilation is unavailable;
- `fused`: the fast rollout as one C++ loop on the CPU (head_kernel.py; the default, because op dispatch, not
  arithmetic, is the head's cost on a CPU), greedy or sampled (a sampled slot draws from its q by inverse CDF with
  a uniform taken from the caller's generator); falls back to `fast` on GPUs and where no C++ compiler is found.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..sampling import sample_from, top_children
from .frspec import q_to_vocab, to_vocab
from .head_kernel import (FusedWeights, fused_best_first, fused_branch_level, fused_greedy_rollout,
                          fused_sampled_rollout, prepare)


@dataclass
class Rollout:
    tokens: torch.Tensor            # [b, n] drafted vocabulary ids
    q: torch.Tensor | None          # [b, n, V] the exact distributions the drafts were sampled from (T > 0)
    top: tuple[torch.Tensor, torch.Tensor]   # (vocabulary ids, values) [b, n, k] of the largest final logits
    #                                          (slot 0 is uncorrected: its base top-k over the draft vocabulary)


class DominoHead(nn.Module):
    def __init__(self, hidden_size: int, gru_hidden: int, rank: int, vocab_size: int, correct_first: bool = False):
        super().__init__()
        self.correct_first = correct_first
        self.gru = nn.GRU(hidden_size, gru_hidden, num_layers=1, bias=False, batch_first=True)
        self.w1 = nn.Linear(hidden_size + gru_hidden, rank, bias=False)
        self.w2 = nn.Linear(rank, vocab_size, bias=False)   # own weights, not tied to the LM head
        self._table = None    # (key, V x 3g input projections) for the fast path
        self._fused = None    # (the _table entry it was built from, FusedWeights or None)

    def correction(self, h: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """dL = W2 . SiLU(W1 . [H ; S]) for any leading shape."""
        return self.w2(F.silu(self.w1(torch.cat([h, s], dim=-1))))

    def prefix_states(self, prefix_emb: torch.Tensor) -> torch.Tensor:
        """[M, n, H] embeddings of [anchor, t_1, ..., t_{n-1}] -> GRU outputs [M, n, g], zero initial state.

        Output i has consumed the anchor and i prefix tokens: the state that corrects draft i.
        """
        out, _ = self.gru(prefix_emb)
        return out

    def step(self, emb: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
        """Advance the GRU by one token: emb [b, H], state [b, g] or None (= zeros) -> new state [b, g]."""
        _, h = self.gru(emb.unsqueeze(1), None if state is None else state.unsqueeze(0).contiguous())
        return h.squeeze(0)

    def corrected_logits(self, h: torch.Tensor, base: torch.Tensor, prefix_emb: torch.Tensor) -> torch.Tensor:
        """Teacher-forced final logits for all drafts at once; draft 0 stays the base logits unless correct_first.

        h, base: [M, n, H], [M, n, V]; prefix_emb: [M, n, H] (anchor + the n-1 tokens before each draft).
        """
        if self.correct_first:
            return base + self.correction(h, self.prefix_states(prefix_emb))
        if base.shape[1] <= 1:
            return base
        s = self.prefix_states(prefix_emb)
        delta = self.correction(h[:, 1:], s[:, 1:])
        return torch.cat([base[:, :1], base[:, 1:] + delta], dim=1)

    def first_final(self, h: torch.Tensor, base: torch.Tensor, anchor: torch.Tensor, embed_weight: torch.Tensor,
                    vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Drafting's logits [b, m, V'] with draft 0 final: base itself unless correct_first, else base with
        dL_0(H_0, GRU(E(anchor))) added to slot 0 (over the FR-Spec columns `vocab_ids` when given). Every
        rollout and tree path then treats slot 0 as they treat an uncorrected one: its logits are final."""
        if not self.correct_first:
            return base
        s0 = self.step(F.embedding(anchor, embed_weight), None)
        w2 = self.w2.weight if vocab_ids is None else self.w2.weight[vocab_ids]
        delta = F.silu(self.w1(torch.cat([h[:, 0], s0], dim=-1))) @ w2.t()
        return torch.cat([base[:, :1] + delta[:, None].to(base.dtype), base[:, 1:]], dim=1)

    # ---- fast inference path ---------------------------------------------------------------------
    def fast_weights(self, embed_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(E . W_ih^T [V, 3g] in PyTorch's gate order r, z, n; [W1_S ; W_hh]^T [g, r + 3g]; W1_H [r, H]).

        The table turns each step's GRU input projection into a row gather; stacking W1_S over W_hh lets one
        matmul of the new state give both its correction input and the next step's recurrent gates; W1_H is kept
        contiguous for the fused loop. Rebuilt whenever a weight changes (optimizer steps and load_state_dict bump
        the tensors' version counters), so validation during training never reads a stale table.
        """
        ws = (embed_weight, self.gru.weight_ih_l0, self.gru.weight_hh_l0, self.w1.weight, self.w2.weight)
        key = tuple((w.data_ptr(), w._version, w.dtype, w.device) for w in ws)
        if self._table is None or self._table[0] != key:
            with torch.no_grad():
                hidden = self.w1.in_features - self.gru.hidden_size
                table = embed_weight @ self.gru.weight_ih_l0.t()
                stacked = torch.cat([self.w1.weight[:, hidden:], self.gru.weight_hh_l0], dim=0).t().contiguous()
                w1_h = self.w1.weight[:, :hidden].contiguous()
            self._table = (key, (table, stacked, w1_h))
        return self._table[1]

    def fused_weights(self, embed_weight: torch.Tensor) -> FusedWeights | None:
        """The fused loop bound to the current weights (rebuilt with the fast path's table); None where it cannot
        run (see head_kernel.prepare)."""
        table, w_s, w1_h = self.fast_weights(embed_weight)
        if self._fused is None or self._fused[0] is not self._table:
            self._fused = (self._table, prepare(table, w_s, w1_h, self.w2.weight))
        return self._fused[1]

    @torch.no_grad()
    def rollout(self, h: torch.Tensor, base: torch.Tensor, anchor: torch.Tensor, embed_weight: torch.Tensor, n: int,
                base_top: tuple[torch.Tensor, torch.Tensor], pool: int = 0, temperature: float = 0.0,
                top_p: float = 1.0, generator: torch.Generator | None = None, impl: str = "fast",
                vocab_ids: torch.Tensor | None = None, topk: int = 5) -> Rollout:
        """Draft n tokens sequentially. h [b, m, H], base [b, m, V] (m >= n slots), anchor [b]; base_top: the base
        top-k (vocabulary ids, values) [b, n, k] of `base`, which is slot 0's final top-k (`base` carries slot 0's
        final logits: uncorrected, or corrected by `first_final`).

        impl: "eager" (nn.GRU, full-vocabulary correction: the reference), "fast" (torch ops), "compiled"
        (torch.compile: greedy only) or "fused" (the C++ loop of head_kernel.py: greedy or sampled);
        both fall back to "fast" where they cannot run.

        Greedy fast paths score the correction on a pool of K tokens and draft its argmax. At T > 0 the pool is not
        used: a draft sampled from a softmax over K tokens would be exact (q is what it was drawn from) but q would
        have no mass outside them, where the target's p has some, and acceptance falls (the shipped Domino drafter on
        math at T = 1: first-draft acceptance 0.54 with K = 64 against 0.60 over the whole draft vocabulary, τ 4.64
        against 5.06); the correction over the whole draft vocabulary costs one [r] x [r, V'] product per slot.
        Draft 0 uses the full base logits.

        FR-Spec (`vocab_ids` [K'] sorted vocabulary ids): `base` is over that subset only and the rollout runs in
        it (W2 restricted to its rows, the pool drawn from it); drafted tokens are vocabulary ids, and q is zero
        outside the subset.
        """
        if impl == "eager":
            return self._eager_rollout(h, base, anchor, embed_weight, n, temperature, top_p, generator, vocab_ids,
                                       topk)
        fw = self.fused_weights(embed_weight) if impl == "fused" else None
        if fw is not None and temperature <= 0:
            out = fused_greedy_rollout(fw, h[:, :n], base[:, :n], anchor, pool, vocab_ids, topk)
            if out is not None:
                return Rollout(out[0], None, out[3])
        elif fw is not None:
            out = fused_sampled_rollout(fw, h[:, :n], base[:, :n], anchor, temperature, top_p, generator, vocab_ids,
                                        topk)
            if out is not None:
                return Rollout(out[0], q_to_vocab(out[1], vocab_ids, embed_weight.shape[0]), out[2])
        table, w_s, w1_h = self.fast_weights(embed_weight)
        w2 = self.w2.weight
        if vocab_ids is not None:
            w2 = w2[vocab_ids]
        if temperature <= 0:
            fn = compiled_greedy_rollout(h.device) if impl == "compiled" else greedy_rollout
            tokens, logits, ids = fn(table, w_s, w1_h, w2, h, base, anchor, pool, vocab_ids)
            return Rollout(tokens[:, :n], None, _final_top(logits[:, :n], ids, base_top, topk))
        h, base = h[:, :n], base[:, :n]
        b = base.shape[0]
        V = embed_weight.shape[0]
        hw, ids, w2t, scores = _pool(h, w1_h, w2, base, 0)          # sampling: no pool (see above)
        full_ids = _vocab_ids(ids, vocab_ids, b)      # vocabulary id of every logit column (None = identity)
        logits_out = scores.clone()
        tokens = torch.empty(b, n, dtype=torch.long, device=base.device)
        q = torch.zeros(b, n, V, dtype=torch.float64, device=base.device)
        state = gru_cell(F.embedding(anchor, table), None, None)
        proj = state @ w_s
        for i in range(n):
            if i == 0:                                    # draft 0 is uncorrected: the full base logits
                logits, cols = base[:, 0], _vocab_ids(None, vocab_ids, b)
            else:
                state, proj, delta = _step(tok, state, proj, table, w_s, hw[:, i], w2t, ids)
                logits = logits_out[:, i]
                logits += delta
                cols = full_ids
            choice, probs = sample_from(logits, temperature, top_p, generator)
            tok = choice if cols is None else cols.gather(-1, choice.unsqueeze(-1)).squeeze(-1)
            if cols is None:
                q[:, i] = probs
            else:
                q[:, i].scatter_(-1, cols, probs)
            tokens[:, i] = tok
        return Rollout(tokens, q, _final_top(logits_out, full_ids, base_top, topk))

    @torch.no_grad()
    def branches(self, h: torch.Tensor, base: torch.Tensor, anchor: torch.Tensor, embed_weight: torch.Tensor,
                 pool: int = 0, vocab_ids: torch.Tensor | None = None, base_top=None, impl: str = "fast"
                 ) -> "Branches":
        """The head along many branches of one block (tree drafting): h [1, n, H], base [1, n, V], anchor [1].
        impl "fused" steps each level in the C++ loop where it can run (else, and for any other impl, torch ops)."""
        return Branches(self, h, base, anchor, embed_weight, pool, vocab_ids, base_top, impl)

    def _eager_rollout(self, h, base, anchor, embed_weight, n, temperature, top_p, generator, vocab_ids, topk
                       ) -> Rollout:
        """The reference: nn.GRU one token at a time, the correction over the whole (draft) vocabulary."""
        tokens, finals, qs = [], [], []
        state = None
        prev = anchor
        for i in range(n):
            logits = base[:, i]
            # The GRU has now consumed [anchor, d_0..d_{i-1}]; draft 0 has nothing to condition on.
            state = self.step(F.embedding(prev, embed_weight), state)
            if i > 0:
                delta = self.correction(h[:, i], state)
                logits = logits + (delta if vocab_ids is None else delta[:, vocab_ids])
            tok, q = sample_from(logits, temperature, top_p, generator)
            tok = to_vocab(tok, vocab_ids)
            tokens.append(tok)
            finals.append(logits)
            qs.append(q_to_vocab(q, vocab_ids, embed_weight.shape[0]))
            prev = tok
        ft = torch.stack(finals, dim=1).topk(min(topk, base.shape[-1]), dim=-1)
        q = torch.stack(qs, dim=1) if temperature > 0 else None
        return Rollout(torch.stack(tokens, dim=1), q, (to_vocab(ft.indices, vocab_ids), ft.values))


class Branches:
    """Tree expander with the head: the children of a node at depth i are the corrected logits of draft i given the
    node's own path, `L^base_i + ΔL_i(h_i, S(anchor, path))`. Every branch keeps its own GRU state; one call steps
    all branches of a level together (one fused-loop call, or the fast path's ops batched over branches), so a tree
    of depth n costs n − 1 batched head steps. Slot 0 is uncorrected, as in a chain. Scored on the same candidate
    pool as the chain's rollout, so the branch that follows the pool argmax at every depth is the chain's draft.

    Unlike the chain's step, which projects every new state through [W1_S ; W_hh] at once, a branch's recurrent
    gates W_hh·S are computed only when the branch gets children of its own, once per distinct parent: most nodes
    of a best-first tree are leaves, and W_hh (3g × g) is most of the head's arithmetic."""

    def __init__(self, head: DominoHead, h, base, anchor, embed_weight, pool, vocab_ids, base_top, impl="fast"):
        self.table, w_s, w1_h = head.fast_weights(embed_weight)
        self.base, self.vocab_ids, self.base_top = base[0], vocab_ids, base_top
        # impl "fused": each level is one call of the C++ loop (head_kernel.cpp), as the chain's rollout is; a
        # level in torch ops is ~20 small ops whose dispatch, not arithmetic, is its cost on a CPU
        fw = head.fused_weights(embed_weight) if impl == "fused" and base.device.type == "cpu" else None
        self.fw = fw if fw is not None and fw.dtype == base.dtype == h.dtype else None
        if self.fw is not None:
            self.hw = h[0] @ w1_h.t()                                       # [n, r]
            pool_ids, scores = _pool_columns(base, pool)
            self.scores = scores[0]                                          # [n, K]
            cols = _vocab_ids(pool_ids, vocab_ids, 1)
            self.cols = torch.arange(base.shape[-1], device=base.device) if cols is None else cols[0]
            self.states = fused_branch_level(self.fw, h.new_empty(0, head.gru.hidden_size), torch.tensor([-1]),
                                             anchor, None, None, None, 0)[0]
        else:
            r = head.w1.out_features
            self.w1s_t, self.whh_t = w_s[:, :r].contiguous(), w_s[:, r:].contiguous()
            w2 = head.w2.weight if vocab_ids is None else head.w2.weight[vocab_ids]
            self.hw, pool_ids, w2t, self.scores = _pool(h, w1_h, w2, base, pool)
            self.hw, self.scores = self.hw[0], self.scores[0]
            self.w2t = w2t if pool_ids is None else w2t[0]           # [r, V] or the block's pool [r, K]
            self.cols = _vocab_ids(pool_ids, vocab_ids, 1)           # vocabulary ids of the columns, or None
            self.states = gru_cell(F.embedding(anchor, self.table), None, None)
        # the states of the last expanded level, one row per node id (-1 = the anchor, whose state has read it)
        self.rows = {-1: 0}

    def children(self, level: int, ids: list[int], tokens: list[int] | None, parents: list[int] | None, k: int):
        """Top-k children (log-probabilities, vocabulary ids, logits) of the nodes `ids` at depth `level` (their
        tokens and parents' ids given; parents are nodes of the previous call), one row per node."""
        if level == 0:                                         # draft 0 is uncorrected: the full base logits
            return top_children(self.base[0][None], k, self.vocab_ids)
        rows = torch.tensor([self.rows[g] for g in parents], device=self.states.device)
        tok = torch.tensor(tokens, device=self.states.device)
        self.rows = {g: r for r, g in enumerate(ids)}
        if self.fw is not None:
            self.states, logp, top_ids, top = fused_branch_level(self.fw, self.states, rows, tok, self.hw[level],
                                                                 self.scores[level], self.cols, k)
            return logp.float(), top_ids, top.float()           # as top_children ranks them
        uniq, inv = rows.unique(return_inverse=True)
        prev = self.states[uniq]
        gh = prev @ self.whh_t                                 # recurrent gates, once per distinct parent
        state = gru_cell(F.embedding(tok, self.table), gh[inv], prev[inv])     # has read the node's own token
        u = F.silu(self.hw[level] + state @ self.w1s_t)
        self.states = state
        return top_children(self.scores[level] + u @ self.w2t, k, self.cols)

    def best_first(self, n_nodes: int, depth: int, k: int, topk: int, min_logp: float):
        """decoding.tree.build_tree's tree in one call of the loop (head_kernel.fused_best_first: the levels and
        the selection between them), or None without the loop. Returns what build_tree assembles the tree from:
        (tokens, parents, depths, scores of the nodes in creation order, the kept nodes best first, {expanded node
        (-1 = the anchor): (its first topk children's vocabulary ids, logits)})."""
        depth = min(depth, self.hw.shape[0])
        if self.fw is None or depth < 1:
            return None
        logp0, ids0, logits0 = (x[0] for x in self.children(0, [-1], None, None, k))
        out = fused_best_first(self.fw, self.states, self.hw, self.scores, self.cols, logp0, ids0, n_nodes,
                               depth, k, topk, min_logp)
        out[-1][-1] = (ids0[:topk].tolist(), logits0[:topk].tolist())
        return out


def _final_top(logits: torch.Tensor, ids: torch.Tensor | None, base_top, k: int):
    """Top-k (vocabulary ids, values) of final logits [b, n, K] whose columns are the vocabulary ids `ids` [b, K]
    (None: the whole vocabulary). Slot 0 is uncorrected: over a pool its final top-k is the base top-k, which
    ranks the whole draft vocabulary instead of the pool."""
    ft = logits.topk(min(k, logits.shape[-1]), dim=-1)
    f_ids = ft.indices if ids is None else ids.unsqueeze(1).expand_as(logits).gather(-1, ft.indices)
    f_vals = ft.values
    if ids is not None and f_vals.shape[-1] == base_top[0].shape[-1]:
        f_ids, f_vals = f_ids.clone(), f_vals.clone()
        f_ids[:, 0], f_vals[:, 0] = base_top[0][:, 0], base_top[1][:, 0]
    return f_ids, f_vals


def _vocab_ids(ids: torch.Tensor | None, vocab_ids: torch.Tensor | None, b: int) -> torch.Tensor | None:
    """Vocabulary ids [b, K] of the rollout's logit columns: pool ids (indices into the FR-Spec subset when
    there is one) mapped through the subset; None when the columns are the whole vocabulary."""
    if vocab_ids is None:
        return ids
    return vocab_ids.expand(b, -1) if ids is None else vocab_ids[ids]


def gru_cell(gi: torch.Tensor, gh: torch.Tensor | None, state: torch.Tensor | None) -> torch.Tensor:
    """One bias-free GRU step from input gates gi = W_ih x and recurrent gates gh = W_hh s ([b, 3g] each),
    in PyTorch's gate order: r = σ(gi_r + gh_r), z = σ(gi_z + gh_z), n = tanh(gi_n + r ⊙ gh_n),
    s' = (1 − z) ⊙ n + z ⊙ s. state None is the zero state (the recurrent terms vanish)."""
    g = gi.shape[-1] // 3
    if state is None:
        n = torch.tanh(gi[:, 2 * g:])
        return n - torch.sigmoid(gi[:, g: 2 * g]) * n
    r_z = torch.sigmoid(gi[:, : 2 * g] + gh[:, : 2 * g])
    n = torch.tanh(gi[:, 2 * g:] + r_z[:, :g] * gh[:, 2 * g:])
    return n + r_z[:, g:] * (state - n)


def _pool_columns(base, pool: int):
    """(pool ids [b, K] or None = every column, base logits over the pool [b, n, K]): the pool is the top-K of the
    per-token max base logit over the block's slots."""
    b, n, V = base.shape
    if 0 < pool < V:
        ids = base.amax(dim=1).topk(pool, dim=-1).indices
        return ids, base.gather(-1, ids.unsqueeze(1).expand(b, n, pool))
    return None, base


def _pool(h, w1_h, w2, base, pool: int):
    """(W1_H . H for every slot [b, n, r], pool ids [b, K] or None, W2 rows to score, base logits over the pool)."""
    ids, scores = _pool_columns(base, pool)
    return h @ w1_h.t(), ids, (w2.t() if ids is None else w2[ids].transpose(1, 2)), scores


def _step(tok, state, proj, table, w_s, hw_i, w2t, ids):
    """Feed the previous draft to the GRU, then correct the next slot: returns (state, proj, ΔL).

    proj = state @ [W1_S ; W_hh]^T carries both this slot's W1_S s and the next step's recurrent gates W_hh s.
    ΔL = W2 . SiLU(W1_H h + W1_S s), on the pool ([b, r] x [b, r, K]) or the full vocabulary ([b, r] x [r, V])."""
    r = hw_i.shape[-1]
    state = gru_cell(F.embedding(tok, table), proj[:, r:], state)     # now has consumed the previous draft
    proj = state @ w_s
    u = F.silu(hw_i + proj[:, :r])
    return state, proj, (u @ w2t if ids is None else torch.bmm(u.unsqueeze(1), w2t).squeeze(1))


def greedy_rollout(table, w_s, w1_h, w2, h, base, anchor, pool: int, vocab_ids=None):
    """Greedy drafts with the fast head as one pure tensor function (so torch.compile can take it whole).

    Returns (tokens [b, n], final logits [b, n, K] over the pool (slot 0: base), vocabulary ids of the logit
    columns [b, K] or None = the whole vocabulary). `vocab_ids`: the FR-Spec subset `base` and `w2` live in."""
    hw, ids, w2t, scores = _pool(h, w1_h, w2, base, pool)
    cols = _vocab_ids(ids, vocab_ids, base.shape[0])
    state = gru_cell(F.embedding(anchor, table), None, None)     # has consumed the anchor
    proj = state @ w_s                                            # [b, r + 3g]: W1_S s and W_hh s in one matmul
    tok = base[:, 0].argmax(-1)
    if vocab_ids is not None:
        tok = vocab_ids[tok]
    tokens, finals = [tok], [scores[:, 0]]
    for i in range(1, base.shape[1]):
        state, proj, delta = _step(tok, state, proj, table, w_s, hw[:, i], w2t, ids)
        logits = scores[:, i] + delta
        choice = logits.argmax(-1)
        tok = choice if cols is None else cols.gather(-1, choice.unsqueeze(-1)).squeeze(-1)
        tokens.append(tok)
        finals.append(logits)
    return torch.stack(tokens, 1), torch.stack(finals, 1), cols


_COMPILED: dict = {}


def compiled_greedy_rollout(device: torch.device):
    """torch.compile(greedy_rollout) per device type (CUDA: CUDA graphs via reduce-overhead); if compilation is
    unavailable (no C++ compiler, unsupported platform) warn once and use the plain function."""
    kind = torch.device(device).type
    if kind not in _COMPILED:
        # CUDA: CUDA graphs. CPU: the C++ wrapper calls the kernels without a Python frame per op, which is
        # most of a tiny rollout's time (measured 1.21 -> 1.02 ms per block-8 rollout on the default drafter)
        opts = {"mode": "reduce-overhead"} if kind == "cuda" else {"options": {"cpp_wrapper": True}}
        fn = torch.compile(greedy_rollout, dynamic=False, fullgraph=True, **opts)

        def guarded(*args):
            try:
                return fn(*args)
            except Exception as e:   # noqa: BLE001 -- any backend failure: fall back, the drafts are the same
                warnings.warn(f"head_impl='compiled' unavailable ({type(e).__name__}: {str(e)[:200]}); using 'fast'")
                _COMPILED[kind] = greedy_rollout
                return greedy_rollout(*args)
        _COMPILED[kind] = guarded
    return _COMPILED[kind]
