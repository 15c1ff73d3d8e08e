"""The copy input of block drafters (DrafterConfig.copy_ngram): candidates, losslessness, learnability, plumbing."""
from __future__ import annotations

import pytest
import torch

from domino_lab import Drafter
from domino_lab.decoding import speculative_generate
from domino_lab.decoding.batched import batched_generate
from domino_lab.decoding.lookup import COPY_TRACK, block_copy_inputs, copy_index, copy_inputs
from domino_lab.errors import UserError
from domino_lab.models.config import DrafterConfig
from domino_lab.models.export import release_state_dict
from domino_lab.training.module import warm_start
from domino_lab.training.objective import sample_anchors, weighted_ce

from core_helpers import tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab=48, layers=4, hidden=32, eos=None)


def test_training_candidates_are_what_decoding_proposes():
    """block_copy_inputs (training) gives, for every anchor, what an index over the text up to the anchor proposes
    at decoding time: the same inputs in both, including no-match rows and loops copied past the end."""
    g = torch.Generator().manual_seed(0)
    pattern = torch.randint(5, 40, (7,), generator=g)
    ids = torch.stack([torch.cat([torch.randint(5, 40, (9,), generator=g), pattern.repeat(4)]),
                       torch.randint(5, 40, (37,), generator=g)])
    anchors = torch.tensor([[3, 20, 36, 12], [0, 5, 30, 36]])
    cands, lens, record = block_copy_inputs(ids, anchors, 6, 2)
    assert cands.shape == (2, 4, 6) and lens.shape == (2, 4) and record.shape == (2, 4, 2)
    for i in range(2):
        for j, a in enumerate(anchors[i].tolist()):
            want_c, want_m, want_r = copy_inputs([copy_index(2, ids[i, : a + 1].tolist())], 6)
            assert cands[i, j].tolist() == want_c[0].tolist() and int(lens[i, j]) == int(want_m[0])
            assert record[i, j].tolist() == want_r[0].tolist()
    # inside the repeated pattern the copy is the pattern's continuation, also past the end of the text
    a = 36
    nxt = [int(pattern[(a + 1 - 9 + k) % 7]) for k in range(6)]
    assert cands[0, 2].tolist() == nxt and int(lens[0, 2]) >= 2
    assert cands[0, 0].tolist() == [-1] * 6 and int(lens[0, 0]) == 0     # nothing repeated yet
    # the record: inside the repeats the copy has been drafting every token right; random text has no hits
    hits, misses = record[0, 2].tolist()
    assert hits * COPY_TRACK >= 15 and misses * COPY_TRACK <= 2
    assert record[1, 3, 0] == 0 or record[1, 3, 0] < record[0, 2, 0]


@pytest.mark.parametrize("method", ["dflash", "domino"])
def test_copy_drafter_is_lossless_in_every_mode(target, method):
    """Greedy chain, tree and batched decoding with a copy drafter (FR-Spec list included: candidates outside it
    extend the draft vocabulary) equal plain greedy decoding; T > 0 runs."""
    torch.manual_seed(0)
    d = Drafter.untrained(target, method, copy_ngram=2, frspec_k=12)
    d.set_frspec(range(5, 17))
    prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 12, 13, 9, 10, 11], [20, 21, 22, 23]]
    for p in prompts:
        ref = speculative_generate(target, None, prompt_ids=p, max_new_tokens=30).token_ids
        for nodes in (0, 12):
            out = speculative_generate(target, d, prompt_ids=p, max_new_tokens=30, tree_nodes=nodes)
            assert out.token_ids == ref
        out = speculative_generate(target, d, prompt_ids=p, max_new_tokens=20, temperature=0.8, seed=1)
        assert len(out.token_ids) == 20
    res = batched_generate(target, d, prompts, max_new_tokens=30)
    assert res.token_ids == [speculative_generate(target, None, prompt_ids=p, max_new_tokens=30).token_ids
                             for p in prompts]


def test_candidates_outside_the_frspec_list_can_be_drafted(target):
    """A copy drafter may draft a candidate that its FR-Spec list lacks: the list is extended per block."""
    d = Drafter.untrained(target, "dflash", copy_ngram=2, frspec_k=4).set_frspec([5, 6, 7, 8])
    with torch.no_grad():       # make the backbone's output the copy candidate's embedding, scaled up
        d.copy_input.proj.weight.mul_(50.0)
    h = torch.zeros(1, 8, 32, dtype=target.dtype)
    cands = torch.tensor([[30, 31, 5, -1, 30, 31, 5, 6]])
    base, vm = d.draft_logits(h, cands)
    assert base.shape[-1] == 6 and sorted(vm.tolist()) == [5, 6, 7, 8, 30, 31]


def test_the_unlisted_candidates_are_the_distinct_ids_outside_the_list():
    """The candidates outside the FR-Spec list, for one block's ids, a batch's and a larger set: each distinct
    one once, sorted."""
    d = Drafter.untrained(tiny_target(vocab=48, layers=2, hidden=32, eos=None), "dflash", copy_ngram=2,
                          frspec_k=6).set_frspec([3, 5, 6, 7, 8, 40])
    g = torch.Generator().manual_seed(0)
    for shape in ((1, 8), (2, 8), (4, 40)):
        ids = torch.randint(-1, 48, shape, generator=g)
        want = sorted({i for i in ids.flatten().tolist() if i >= 0} - {3, 5, 6, 7, 8, 40})
        got = d.unlisted(ids)
        assert got.dtype == torch.long and got.tolist() == want
    assert d.unlisted(torch.tensor([[-1, 5, 5, -1]])).numel() == 0
    assert Drafter.untrained(d.target, "dflash", copy_ngram=2).unlisted(torch.tensor([[30]])) is None    # no list

def _accuracy_after_training(drafter, train, test, copy: bool, steps: int) -> float:
    """Train on batches `train()` draws, then the fraction of `test` drafts whose argmax is the label."""
    target, k, n = drafter.target, drafter.config.copy_ngram, drafter.config.num_drafts
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)

    def blocks(seqs):
        with torch.no_grad():
            feats = target.forward(seqs, taps=drafter.config.target_layer_ids).features
        mask = torch.ones_like(seqs)
        anchors, keep = sample_anchors(mask, 8, g)
        kw = {"copy": block_copy_inputs(seqs, anchors, n, k)} if copy else {}
        return drafter.training_blocks(feats, seqs, mask, anchors, keep, **kw)

    for _ in range(steps):
        bb = blocks(train())
        loss = weighted_ce(bb.logits_final, bb.labels, bb.valid, 4.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        bb = blocks(test)
    return float(((bb.logits_final.argmax(-1) == bb.labels) & bb.valid).sum() / bb.valid.sum())


def test_the_copy_input_copies_text_it_never_saw(target):
    """Text that repeats a random pattern: nothing to predict, everything to copy. Trained the same steps on some
    patterns, a drafter with the copy input drafts the repeats of patterns it never saw; one without it has to learn
    to copy through attention, which takes far longer."""
    g = torch.Generator().manual_seed(1)

    def repeats(m):
        return torch.stack([torch.randint(4, 46, (6,), generator=g).repeat(8) for _ in range(m)])

    train, test = (lambda: repeats(6)), repeats(6)
    torch.manual_seed(0)
    with_copy = _accuracy_after_training(Drafter.untrained(target, "dflash", copy_ngram=2, num_layers=1), train,
                                         test, True, 60)
    torch.manual_seed(0)
    without = _accuracy_after_training(Drafter.untrained(target, "dflash", num_layers=1), train, test, False, 60)
    assert with_copy > 0.7 and with_copy > without + 0.3, (with_copy, without)


def test_warm_start_adds_a_copy_input(target):
    """A drafter trained without a copy input warm-starts one with it: every other weight is taken, the copy input
    starts as initialised (identity map, zero length embeddings)."""
    torch.manual_seed(0)
    src = Drafter.untrained(target, "domino")
    dst = Drafter.untrained(target, "domino", copy_ngram=3, seed=1)
    taken = warm_start(dst, src)
    assert not any(k.startswith("copy_input") for k in taken)
    assert torch.equal(dst.backbone.layers[0].mlp.down_proj.weight, src.backbone.layers[0].mlp.down_proj.weight)
    assert torch.equal(dst.copy_input.proj.weight, torch.eye(32, dtype=dst.copy_input.proj.weight.dtype))
    assert dst.copy_input.length.weight.abs().sum().item() == dst.copy_input.record.weight.abs().sum().item() == 0


def test_save_load_and_refusals(target, tmp_path):
    torch.manual_seed(0)
    d = Drafter.untrained(target, "domino", copy_ngram=2)
    d.save_pretrained(tmp_path / "d")
    back = Drafter.from_pretrained(tmp_path / "d", target)
    assert back.config.copy_ngram == 2
    assert all(torch.equal(a, b) for a, b in zip(d.state_dict().values(), back.state_dict().values()))
    with pytest.raises(UserError, match="copy_ngram must be in"):
        DrafterConfig.for_target(target, "domino", copy_ngram=17)
    with pytest.raises(UserError, match="block drafters"):
        DrafterConfig.for_target(target, "eagle", copy_ngram=2)
    with pytest.raises(UserError, match="copy input"):
        release_state_dict(d, "domino")
