"""Sampling, the verification rules (greedy longest prefix; standard speculative sampling; sampling over a draft
tree's fixed candidates), the commit rule and the ranking of a draft tree's children. A leaf module: the drafters
(models/) sample with it and the decoders (decoding/) verify with it."""
from __future__ import annotations

import hashlib
import numbers

import numpy as np
import torch

from .cli_flags import SAMPLERS
from .errors import UserError


# A positive temperature outside these bounds breaks the arithmetic, not the method: logits / T overflows float64 to
# inf below ~1e-307 (softmax then gives NaN), and the gumbel sampler's T-scaled float32 noise overflows above ~1e37.
# Well inside both, T = 1e-6 is greedy decoding in all but name and T = 1e6 uniform sampling.
TEMPERATURE_RANGE = (1e-6, 1e6)


def check_sampling(temperature: float, top_p: float = 1.0, sampler: str = "rejection", tree_sampled: bool = False
                   ) -> None:
    """One clear error for settings no decoder can sample with: T < 0 or a positive T outside TEMPERATURE_RANGE,
    top-p outside (0, 1], an unknown sampler, or a sampled tree (its children drawn for rejection sampling) under the
    gumbel sampler, whose tree is built from the noisy scores instead."""
    real = all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in (temperature, top_p))
    low, high = TEMPERATURE_RANGE
    t_ok = real and (temperature == 0 or low <= temperature <= high)     # (written so that NaN fails too)
    if not t_ok or not 0 < top_p <= 1:
        raise UserError(f"temperature must be a finite number >= 0 (0 = greedy, else from {low:g} to {high:g}) and "
                        f"top_p in (0, 1]; got temperature {temperature!r}, top_p {top_p!r}")
    if sampler not in SAMPLERS:
        raise UserError(f"unknown sampler {sampler!r}; use one of {list(SAMPLERS)}")
    if sampler == "gumbel" and temperature > 0 and tree_sampled:
        raise UserError("sampled trees draw their children for rejection sampling; with the gumbel sampler the "
                        "tree is built from the noisy scores: turn tree_sampled off or use the rejection sampler")


def warp_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """softmax(logits / T) restricted to the top-p nucleus and renormalised (computed in float64 on CPU-sized
    vocabularies it is cheap and removes rounding from the acceptance ratio p/q)."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if top_p < 1.0:
        # keep the largest probabilities while the mass before them is < top_p (always the top token), and every
        # token tied with the smallest kept one (so the cut does not depend on how a sort breaks ties): p >= the
        # threshold. Only the sorted values are needed, and on the CPU numpy sorts them ~15x faster than torch.sort
        # (0.26 vs 3.9 ms for 9 rows of 8,192 float64), which a verify step at top-p < 1 paid on every call.
        desc = (torch.from_numpy(-np.sort(-probs.detach().numpy(), axis=-1)) if probs.device.type == "cpu"
                else probs.sort(dim=-1, descending=True).values)
        kept = (desc.cumsum(-1) - desc < top_p).sum(-1, keepdim=True)
        probs = probs * (probs >= desc.gather(-1, kept - 1))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [b, V] -> (token [b], the distribution it was drawn from [b, V] or None when greedy)."""
    if temperature <= 0:
        return logits.argmax(-1), None
    probs = warp_probs(logits, temperature, top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1), probs


class GumbelNoise:
    """Gumbel noise for every absolute position of one sampled decode, a function of (seed, position) alone.

    Gumbel-max: argmax_v(z_v / T + g_v) with g_v iid Gumbel(0, 1) is an exact draw from softmax(z / T). With one
    noise vector per position of the text, plain decoding, any drafter, a chain or a tree, lookup copies and
    adaptive drafts all produce the *same* sampled text for one seed: each token is the target's own Gumbel-max
    draw at its position, and a draft only decides how many of those draws one forward checks. The drafter
    proposes argmax(its logits / T + g) at the same positions, which agrees with the target's draw with
    probability at least (1 - TV) / (1 + TV) (Daliri et al., 2024: drafter-invariant speculative decoding),
    against standard speculative sampling's 1 - TV (docs/design.md#gumbel-coupled-sampling).

    `rows(positions)` returns T · g [len(positions), V] (T folded in: argmax(z + T·g) = argmax(z / T + g)), each
    position's row drawn once per decode and kept until `forget` drops the positions already committed."""

    def __init__(self, seed: int, vocab_size: int, temperature: float, device=None):
        self.seed, self.vocab_size, self.temperature = int(seed), vocab_size, float(temperature)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._rows: dict[int, torch.Tensor] = {}

    def _row(self, pos: int) -> torch.Tensor:
        row = self._rows.get(pos)
        if row is None:
            # a generator per position, seeded by a hash of (seed, position): the row does not depend on which
            # positions were asked for before it, or in which order
            key = int.from_bytes(hashlib.blake2b(f"gumbel/{self.seed}/{pos}".encode(), digest_size=8).digest(),
                                 "little") >> 1
            u = torch.rand(self.vocab_size, generator=torch.Generator().manual_seed(key), dtype=torch.float64)
            # u = 0 gives -inf (that token never wins); u < 1 always
            row = (-torch.log(-torch.log(u)) * self.temperature).float().to(self.device)
            self._rows[pos] = row
        return row

    def rows(self, positions) -> torch.Tensor:
        return torch.stack([self._row(int(t)) for t in positions])

    def forget(self, below: int) -> None:
        """Drop the rows of positions < below (committed text: no draft or verify reads them again)."""
        for t in [t for t in self._rows if t < below]:
            del self._rows[t]


def gumbel_choice(logits: torch.Tensor, noise: torch.Tensor, temperature: float, top_p: float = 1.0
                  ) -> torch.Tensor:
    """The target's Gumbel-max draws at these positions: argmax over the top-p nucleus of logits + T·g.
    logits [r, V], noise [r, V] from `GumbelNoise.rows` -> tokens [r]; each is an exact draw from
    warp_probs(logits, temperature, top_p)."""
    scores = logits.float() + noise
    if top_p < 1.0:
        scores = scores.masked_fill(warp_probs(logits, temperature, top_p) == 0, -torch.inf)
    return scores.argmax(-1)


def greedy_accept_one(drafts: list[int], target_best: torch.Tensor) -> tuple[int, int]:
    """drafts [n] as a list, target_best [n+1] (the target's argmax token at each verified position: the engine
    reads them from Target.greedy_tokens) -> (accepted count, the target's own next token).

    A draft is accepted while it equals the target's argmax at its position; the target's argmax after the last
    accepted draft is the bonus token. Decided on the host: one transfer, then a scan of at most n pairs, instead
    of a handful of small tensor ops, which on a small target are a visible share of a step."""
    return _first_disagreement(drafts, target_best.tolist())


def greedy_accept(drafts: torch.Tensor, target_best: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule for a batch: drafts [b, n], target_best [b, n+1] -> (accepted count [b], the target's own
    next token [b]), with one transfer for the whole batch."""
    best = target_best.tolist()
    acc, nxt = zip(*(_first_disagreement(d, b) for d, b in zip(drafts.tolist(), best)))
    return torch.tensor(acc, device=drafts.device), torch.tensor(nxt, device=drafts.device)


def _first_disagreement(drafts: list[int], best: list[int]) -> tuple[int, int]:
    acc = next((i for i, (d, b) in enumerate(zip(drafts, best)) if d != b), len(drafts))
    return acc, best[acc]


def confident_prefix(top_logits: torch.Tensor, cutoff: float) -> int:
    """How many drafts to verify: the longest prefix whose estimated probability of being accepted whole, the
    product of each draft's probability, stays >= cutoff (at least one draft). top_logits [n, k]: the drafter's
    final top-k logits per draft, best first; a draft's probability is its softmax over those k, an over-estimate
    of the full softmax, so the estimate errs toward verifying more (docs/design.md#draft-length-cutoff)."""
    p = torch.softmax(top_logits.float(), dim=-1)[:, 0]
    return max(1, int((p.cumprod(0) >= cutoff).sum()))


def commit(accepted: list[int], bonus: int | None, eos: set[int] | frozenset[int], room: int
           ) -> tuple[list[int], int, int | None]:
    """The tokens a verify step adds to the output: the accepted drafts plus the bonus, cut after the first EOS
    (an accepted EOS ends the text: no bonus after it) and to `room` tokens of budget.

    Returns (committed, accepted drafts kept, bonus or None)."""
    for j, t in enumerate(accepted):
        if t in eos:
            accepted, bonus = accepted[: j + 1], None
            break
    committed = accepted + ([bonus] if bonus is not None else [])
    return committed[:room], len(accepted), bonus


def rejection_accept(drafts: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[int, int]:
    """Standard speculative sampling (Leviathan et al.; Chen et al.).

    drafts [n] sampled from q [n, V]; p [n+1, V] the target's warped distributions. Accept d_i with
    probability min(1, p_i(d_i)/q_i(d_i)); on the first rejection draw from norm(max(p_i - q_i, 0)); if all
    are accepted draw the bonus from p_n. The committed tokens are then distributed exactly as the target's.
    q None: the drafts were chosen deterministically (copied text), i.e. q_i is the point mass on d_i: accept
    with probability p_i(d_i), else draw from p_i without d_i.
    """
    n = drafts.shape[0]
    for i in range(n):
        # one position is the one-candidate case of the tree rules below
        d = [int(drafts[i])]
        j, tok = accept_drawn(d, q[i], p[i], generator) if q is not None else accept_candidates(d, p[i], generator)
        if j is None:
            return i, tok
    return n, int(torch.multinomial(p[n], 1, generator=generator))


def accept_candidates(candidates: list[int], p: torch.Tensor, generator: torch.Generator | None = None
                       ) -> tuple[int | None, int]:
    """Speculative sampling at one position over several distinct candidates chosen without randomness (a draft
    tree's children of one node): the token it returns is distributed exactly as p [V].

    Test the candidates in turn against the residual r (at first p): accept candidate c with probability
    r(c) / Σr, else remove c from r and go on; when every candidate is rejected, draw from what is left of r. Then
    P(c_1) = p(c_1), P(c_2) = (1 - p(c_1)) · p(c_2) / (1 - p(c_1)) = p(c_2), and so on, and a token outside the
    candidates is drawn with probability (1 - Σ p(c)) · p(x) / (1 - Σ p(c)) = p(x): point-mass proposals make the
    acceptance ratio of the standard rule p(c) itself, and each rejection's residual is p with c removed
    (docs/design.md#tree-verification). Returns (the accepted candidate's index, its token), or (None, the token
    drawn from the residual)."""
    residual, mass = p, float(p.sum())
    for j, c in enumerate(candidates):
        pc = float(residual[c])
        u = float(torch.rand((), generator=generator, device=p.device, dtype=torch.float64))
        if u * mass < pc:                          # probability pc / mass; a token with pc = 0 never passes
            return j, c
        if residual is p:
            residual = p.clone()
        residual[c] = 0
        mass -= pc
    total = residual.sum()
    dist = residual / total if total > 0 else p    # (all of p's mass was on rejected candidates: rounding only)
    return None, int(torch.multinomial(dist, 1, generator=generator))


def draw_without_replacement(logits: torch.Tensor, k: int, generator: torch.Generator | None = None) -> list[int]:
    """k indices drawn without replacement from softmax(logits) [C], in the order they were drawn: the top-k of the
    logits plus Gumbel noise (Gumbel-top-k)."""
    u = torch.rand(logits.shape, generator=generator, dtype=torch.float64, device=logits.device)
    return (logits.double() - torch.log(-torch.log(u))).topk(min(k, logits.shape[-1])).indices.tolist()


def accept_drawn(candidates: list[int], q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None = None
                 ) -> tuple[int | None, int]:
    """Speculative sampling at one position over candidates drawn from q [V] *without replacement*, in the order
    they were drawn (recursive rejection sampling): the token it returns is distributed exactly as p [V].

    Candidate i was drawn from q_i, q with the earlier candidates removed and renormalised. Accept it with
    probability min(1, r_i(c) / q_i(c)), r_1 = p; on rejection r_{i+1} = norm(max(r_i - q_i, 0)), and after the last
    one draw from r. Each step emits y with probability min(q_i, r_i)(y) + max(r_i - q_i, 0)(y) = r_i(y), so the
    whole test emits p (docs/design.md#tree-verification). Returns (the accepted candidate's index, its token), or
    (None, the token drawn from the residual)."""
    r, qi = p, q
    for j, c in enumerate(candidates):
        u = float(torch.rand((), generator=generator, device=p.device, dtype=torch.float64))
        if u * float(qi[c]) < float(r[c]):
            return j, c
        rest = (r - qi).clamp_min(0)
        total = rest.sum()
        if total > 0:                              # (0 only by rounding: then r = q_i and nothing is rejected)
            r = rest / total
        if j + 1 == len(candidates):
            break                                  # (no q_{i+1} to build after the last candidate)
        qi = qi.clone()
        qi[c] = 0
        mass = qi.sum()
        if mass <= 0:                              # q had no other token: no candidate can follow
            break
        qi = qi / mass
    return None, int(torch.multinomial(r, 1, generator=generator))


def top_children(logits: torch.Tensor, k: int, cols: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The k most probable next tokens per row of logits [r, C] (tree drafting ranks branches by them).

    cols: the vocabulary id of every column ([C] or [1, C]; None = the column index, i.e. the whole vocabulary).
    Returns (log-probabilities under softmax(logits) [r, k], vocabulary ids [r, k], the logits [r, k]), best first."""
    logits = logits.float()
    top = logits.topk(min(k, logits.shape[-1]), dim=-1)
    logp = top.values - torch.logsumexp(logits, -1, keepdim=True)
    ids = top.indices if cols is None else cols.reshape(1, -1).expand(logits.shape[0], -1).gather(-1, top.indices)
    return logp, ids, top.values
