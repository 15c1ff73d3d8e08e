"""T>0: speculative sampling must reproduce the target's distribution exactly; a wrong rule must fail."""
import itertools
from collections import Counter

import pytest
import torch

from domino_lab import Drafter, speculative_generate
from domino_lab import sampling
from domino_lab.decoding import engine
from core_helpers import tiny_target


def tv(counts: Counter, exact: dict, n: int) -> float:
    return 0.5 * sum(abs(counts.get(k, 0) / n - p) for k, p in exact.items())


def test_rejection_rule_single_step_matches_p():
    """First committed token of one verify step ~ p_0, for any q, over many draws."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.05], [0.2, 0.2, 0.2, 0.2, 0.2]], dtype=torch.float64)
    q = torch.tensor([[0.05, 0.05, 0.1, 0.3, 0.5]], dtype=torch.float64)
    n = 20000
    counts = Counter()
    for _ in range(n):
        d = torch.multinomial(q[0], 1, generator=g)
        acc, nxt = sampling.rejection_accept(d, q, p, g)
        counts[int(d[0]) if acc == 1 else nxt] += 1
    assert tv(counts, dict(enumerate(p[0].tolist())), n) < 0.02
    # "sample-and-keep" (always accept the draft) gives q, not p
    assert tv(Counter({k: v for k, v in enumerate((q[0] * n).tolist())}), dict(enumerate(p[0].tolist())), n) > 0.3


def exact_distribution(target, prompt, length, temperature):
    """Enumerate every continuation of `length` tokens and its probability under the target."""
    V = target.vocab_size
    probs = {}
    for seq in itertools.product(range(V), repeat=length):
        ids = torch.tensor([prompt + list(seq)])
        with torch.no_grad():
            logits = target.model(ids).logits[0, len(prompt) - 1: -1]
        lp = torch.log_softmax(logits / temperature, -1)
        probs[seq] = float(torch.exp(sum(lp[i, t] for i, t in enumerate(seq))))
    return probs


@pytest.fixture(scope="module")
def setup():
    # a peaked target (scaled LM head) and a near-uniform untrained drafter: very different p and q
    target = tiny_target(vocab=5, layers=3, hidden=16, eos=None, logit_scale=60.0)
    target.eos_token_ids = set()
    drafter = Drafter.untrained(target, "domino", seed=0, block_size=2)
    prompt = [1, 2, 0]
    exact = exact_distribution(target, prompt, 3, 1.0)
    return target, drafter, prompt, exact


def sample_many(target, drafter, prompt, n):
    return Counter(tuple(speculative_generate(target, drafter, prompt_ids=prompt, max_new_tokens=3,
                                              temperature=1.0, seed=s).token_ids) for s in range(n))


N = 1000


def test_speculative_sampling_matches_target_distribution(setup):
    target, drafter, prompt, exact = setup
    assert max(exact.values()) < 0.9          # the test is meaningless on a near-deterministic target
    counts = sample_many(target, drafter, prompt, N)
    d_spec = tv(counts, exact, N)
    # measured: TV 0.027 at N=1500 (sampling noise); the wrong rule below gives ~0.7
    assert d_spec < 0.08, d_spec


def test_wrong_acceptance_rule_is_caught(setup, monkeypatch):
    target, drafter, prompt, exact = setup

    def accept_everything(drafts, q, p, generator=None):   # "sample from the drafter and keep it"
        return drafts.shape[0], int(torch.multinomial(p[-1], 1, generator=generator))

    monkeypatch.setattr(engine.sampling, "rejection_accept", accept_everything)
    counts = sample_many(target, drafter, prompt, N // 2)
    assert tv(counts, exact, N // 2) > 0.3


@pytest.mark.parametrize("n", [0, 1, 4, 8])
def test_greedy_acceptance_stops_at_the_first_draft_the_target_disagrees_with(n):
    g = torch.Generator().manual_seed(n)
    for trial in range(20):
        logits = torch.randn(n + 1, 50, generator=g)
        best = logits.argmax(-1)
        drafts = best[:n].clone()
        if n and trial % 4:                       # a wrong draft somewhere (all right on every fourth trial)
            j = int(torch.randint(n, (1,), generator=g))
            drafts[j] = (drafts[j] + 1) % 50
        want = next((i for i in range(n) if drafts[i] != best[i]), n)
        assert sampling.greedy_accept_one(drafts.tolist(), best) == (want, int(best[want]))
        acc, nxt = sampling.greedy_accept(drafts[None], best[None])              # the batched rule agrees
        assert (int(acc), int(nxt)) == (want, int(best[want]))
