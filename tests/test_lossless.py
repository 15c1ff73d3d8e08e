"""Greedy speculative output must equal the target's own greedy output, token for token."""
import pytest
import torch

from domino_lab import Drafter, speculative_generate
from core_helpers import brief_train, greedy_sequences

PROMPTS = [[(7 * i + j * 13) % 60 + 4 for j in range(3 + i % 5)] for i in range(32)]


@pytest.fixture(scope="module")
def plain(target):
    """Reference: the target alone (our AR path) and HF generate for every prompt."""
    ref = {}
    for p in PROMPTS:
        ours = speculative_generate(target, None, prompt_ids=p, max_new_tokens=24).token_ids
        hf = target.model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                   do_sample=False, max_new_tokens=24, eos_token_id=3, pad_token_id=0)
        hf_new = hf[0, len(p):].tolist()
        assert ours == hf_new, f"plain decoding differs from HF generate on {p}"
        ref[tuple(p)] = ours
    return ref


@pytest.fixture(scope="module")
def trained(target):
    seqs = greedy_sequences(target, 24, 40)
    out = {}
    for method in ("dflash", "domino"):
        for shift in (True, False):
            d = Drafter.untrained(target, method, seed=1, block_size=8, shift_label=shift, num_layers=1)
            brief_train(d, seqs, steps=40)
            out[method, shift] = d
    return out


CASES = [(m, s, b) for m in ("dflash", "domino") for s in (True, False) for b in (1, 2, 4, 8, 16)
         if not (b == 1 and not s)]


@pytest.mark.parametrize("method,shift,block", CASES)
def test_untrained_drafter_is_lossless(target, plain, method, shift, block):
    d = Drafter.untrained(target, method, seed=block, block_size=block, shift_label=shift)
    # each case sees a different share of the 32 prompts; together every prompt runs per method
    for i, p in enumerate(PROMPTS):
        if i % 4 != (block + shift) % 4 and block != 8:
            continue
        res = speculative_generate(target, d, prompt_ids=p, max_new_tokens=24)
        assert res.token_ids == plain[tuple(p)], (method, shift, block, p)


@pytest.mark.parametrize("method", ["dflash", "domino"])
@pytest.mark.parametrize("shift", [True, False])
def test_trained_drafter_is_lossless_and_accepts(target, plain, trained, method, shift):
    d = trained[method, shift]
    taus = []
    for p in PROMPTS:
        res = speculative_generate(target, d, prompt_ids=p, max_new_tokens=24)
        assert res.token_ids == plain[tuple(p)]
        taus.append(res.mean_acceptance_length)
        assert res.target_forward_calls == len(res.steps) + 1
    # a trained drafter must actually get multi-token steps, or the crop paths were never exercised
    assert max(taus) > 2.0, taus


@pytest.mark.parametrize("block", [2, 4, 8])
def test_block_size_cap_at_generate_time(target, plain, trained, block):
    d = trained["domino", True]
    for p in PROMPTS[:8]:
        res = speculative_generate(target, d, prompt_ids=p, max_new_tokens=24, block_size=block)
        assert res.token_ids == plain[tuple(p)]
        assert all(len(s.draft_tokens) <= block for s in res.steps)


def test_runs_that_end_on_eos(target, trained):
    """Pick an EOS id the target really produces mid-run; every path must stop right after it."""
    base = speculative_generate(target, None, prompt_ids=PROMPTS[0], max_new_tokens=30).token_ids
    eos = base[9]
    target.eos_token_ids = {eos}
    try:
        for p in PROMPTS[:12]:
            ref = speculative_generate(target, None, prompt_ids=p, max_new_tokens=30)
            hf = target.model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                       do_sample=False, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
            assert ref.token_ids == hf[0, len(p):].tolist()
            for d in trained.values():
                res = speculative_generate(target, d, prompt_ids=p, max_new_tokens=30)
                assert res.token_ids == ref.token_ids
                assert res.stop_reason == ref.stop_reason
                if eos in res.token_ids:
                    assert res.token_ids[-1] == eos and res.stop_reason == "eos"
        assert any(eos in speculative_generate(target, None, prompt_ids=p, max_new_tokens=30).token_ids
                   for p in PROMPTS[:12])
    finally:
        target.eos_token_ids = {3}


def test_max_new_tokens_is_exact(target, trained):
    d = trained["domino", True]
    for n in (1, 2, 3, 9, 17):
        res = speculative_generate(target, d, prompt_ids=PROMPTS[3], max_new_tokens=n)
        ref = speculative_generate(target, None, prompt_ids=PROMPTS[3], max_new_tokens=n)
        assert res.token_ids == ref.token_ids
        assert len(res.token_ids) == n or res.stop_reason == "eos"


def test_a_full_context_is_its_own_stop_reason():
    """A prompt that leaves the target's context room for fewer tokens than asked stops with "context_length",
    single and batched; a run that produced what was asked says "max_new_tokens"."""
    from core_helpers import tiny_target
    from domino_lab.decoding.batched import batched_generate

    t = tiny_target(eos=None, max_pos=24)
    long, short = [5 + i % 50 for i in range(17)], [5, 6, 7]
    for d in (None, Drafter.untrained(t, "domino", block_size=4)):
        res = speculative_generate(t, d, prompt_ids=long, max_new_tokens=16)
        assert len(res.token_ids) == 7 and res.stop_reason == "context_length"
        res = speculative_generate(t, d, prompt_ids=long, max_new_tokens=7)
        assert len(res.token_ids) == 7 and res.stop_reason == "max_new_tokens"
        assert speculative_generate(t, d, prompt_ids=short, max_new_tokens=16).stop_reason == "max_new_tokens"
        res = batched_generate(t, d, [long, short], max_new_tokens=16)
        assert [len(x) for x in res.token_ids] == [7, 16]
        assert res.stop_reasons == ["context_length", "max_new_tokens"]


# ---- batched decoding: ragged acceptance through cache holes ----------------------------------------
@pytest.mark.parametrize("drafts", ["all", "adaptive"])
@pytest.mark.parametrize("method", [None, "dflash", "domino"])
def test_batched_equals_per_sequence(target, plain, trained, method, drafts):
    """Every row equals its own greedy decoding, whether each step verifies the whole block or the adaptive count
    (plain steps included), and rows that finish early leave the batch."""
    from domino_lab.decoding.batched import batched_generate

    d = trained[method, True] if method else None
    prompts = PROMPTS[:12]                          # lengths 3..7: left padding differs per row
    for bs in (1, 5, 12):
        for i in range(0, len(prompts), bs):
            batch = prompts[i:i + bs]
            res = batched_generate(target, d, batch, max_new_tokens=24, drafts=drafts)
            for p, toks in zip(batch, res.token_ids):
                assert toks == plain[tuple(p)], (method, bs, p)
            if d is not None and bs > 1:
                # ragged: rows of one batch accepted different numbers of drafts in some step
                assert any(len(set(step)) > 1 for step in zip(*res.acceptance_lengths)), "no ragged step"


@pytest.mark.parametrize("count", [0, 2])
def test_batched_fixed_draft_count(target, plain, trained, count):
    """A fixed draft count verifies at most that many drafts per step (0: plain steps, the drafter never runs) and
    leaves every row equal to its own greedy decoding; a count outside 0..the drafter's drafts is one clear error."""
    from domino_lab.decoding.batched import batched_generate
    from domino_lab.errors import UserError

    d = trained["domino", True]
    prompts = PROMPTS[:10]
    for i in range(0, len(prompts), 5):
        batch = prompts[i:i + 5]
        res = batched_generate(target, d, batch, max_new_tokens=24, drafts=count)
        for p, toks in zip(batch, res.token_ids):
            assert toks == plain[tuple(p)], (count, p)
        lengths = [a for row in res.acceptance_lengths for a in row]
        assert max(lengths) <= count + 1
    if count:
        assert max(lengths) > 1                     # drafts were accepted
    for bad in (-1, d.config.num_drafts + 1):
        with pytest.raises(UserError, match="fixed draft count"):
            batched_generate(target, d, prompts[:2], 4, drafts=bad)
    with pytest.raises(UserError, match="fixed draft count"):
        batched_generate(target, None, prompts[:2], 4, drafts=1)


def test_batched_decoding_refuses_a_block_size_rather_than_ignoring_it(target, trained):
    """Batched decoding chooses each step's draft count itself (the batch-drafts policy or a fixed count); a drafter
    whose options cap the block would otherwise verify whole blocks under its label."""
    from domino_lab.decoding.batched import batched_generate
    from domino_lab.errors import UserError
    from domino_lab.models.options import InferenceOptions

    d = trained["domino", True]
    try:
        d.set_options(InferenceOptions(block_size=2))
        with pytest.raises(UserError, match="a block size is an option of one-sequence decoding"):
            batched_generate(target, d, PROMPTS[:2], 4)
    finally:
        d.set_options(InferenceOptions())


def test_prefill_scores_only_the_last_position(target):
    """A prefill asks for the last position's logits only (the model's logits_to_keep); they are the full
    forward's last row, and the tapped features still cover every position."""
    ids = torch.tensor([PROMPTS[5]])
    full = target.forward(ids, taps=[0, 1])
    last = target.forward(ids, taps=[0, 1], last_logits_only=True)
    assert last.logits.shape == (1, 1, full.logits.shape[-1])
    torch.testing.assert_close(last.logits[:, -1], full.logits[:, -1])
    torch.testing.assert_close(last.features, full.features)


def test_prompt_ids_and_temperature_outside_their_range_are_one_error(target):
    """Token ids outside the target's vocabulary (or not whole numbers) and a NaN or infinite temperature are a
    UserError naming the value, single and batched, not an indexing or sampling failure deep in a forward."""
    from domino_lab.decoding.batched import batched_generate
    from domino_lab.errors import UserError

    v = target.vocab_size
    for ids, word in (([5, v], f"token id {v}"), ([-1, 5], "token id -1"), ([5, 2.5], "token id 2.5"),
                      ([5, "7"], "token id '7'")):
        with pytest.raises(UserError, match=word):
            speculative_generate(target, None, prompt_ids=ids, max_new_tokens=2)
        with pytest.raises(UserError, match=word):
            batched_generate(target, None, [[5, 6], ids], max_new_tokens=2)
    # integral values of other integer-like types are taken as they are
    ref = speculative_generate(target, None, prompt_ids=[5, 6], max_new_tokens=4).token_ids
    assert speculative_generate(target, None, prompt_ids=torch.tensor([5, 6]), max_new_tokens=4).token_ids == ref
    assert speculative_generate(target, None, prompt_ids=[5.0, 6], max_new_tokens=4).token_ids == ref
    # below ~1e-307 logits / T overflow to inf (NaN probabilities), above ~1e37 the gumbel noise does (low ids win)
    for temp in (float("nan"), float("inf"), -0.5, 1e-310, 1e-7, 2e6, 1e300):
        with pytest.raises(UserError, match="temperature must be a finite number >= 0"):
            speculative_generate(target, None, prompt_ids=[5, 6], max_new_tokens=2, temperature=temp)
        with pytest.raises(UserError, match="temperature must be a finite number >= 0"):
            batched_generate(target, None, [[5, 6]], max_new_tokens=2, temperature=temp, sampler="gumbel")
    # the ends of the range decode: T = 1e-6 is greedy decoding in all but name, T = 1e6 draws near-uniform tokens
    assert speculative_generate(target, None, prompt_ids=[5, 6], max_new_tokens=4, temperature=1e-6,
                                seed=0).token_ids == ref
    for sampler in ("rejection", "gumbel"):
        drawn = {speculative_generate(target, None, prompt_ids=[5, 6], max_new_tokens=1, temperature=1e6, seed=s,
                                      sampler=sampler).token_ids[0] for s in range(40)}
        assert len(drawn) > 20, (sampler, drawn)       # of 64 ids, ~30 distinct in 40 uniform draws


def test_a_call_without_a_seed_leaves_torchs_global_stream_alone(target, trained):
    """seed=None draws a fresh seed without reseeding torch's global generator, so a caller's torch.manual_seed still
    fixes what it draws afterwards; batched decoding takes seed=None too (each row seed + r of a fresh seed)."""
    from domino_lab.decoding.batched import batched_generate
    from domino_lab.errors import UserError

    torch.manual_seed(0)
    want = torch.rand(3)
    for decode in (lambda: speculative_generate(target, trained["domino", True], prompt_ids=[5, 6], max_new_tokens=4,
                                                temperature=1.0),
                   lambda: batched_generate(target, trained["domino", True], [[5, 6], [7]], max_new_tokens=4,
                                            temperature=1.0, sampler="gumbel", seed=None)):
        torch.manual_seed(0)
        decode()
        assert torch.equal(torch.rand(3), want)
    with pytest.raises(UserError, match="seed must be a whole number"):
        batched_generate(target, None, [[5, 6]], max_new_tokens=2, seed="1")


def test_a_drafter_bound_to_another_target_object_is_one_error(target, trained):
    """A drafter reads the embeddings and LM head of the target it was loaded for: decoding another Target object
    with it (say the same model in another dtype) is one error up front, not a dtype mismatch inside a matmul."""
    from core_helpers import tiny_target
    from domino_lab.decoding.batched import batched_generate
    from domino_lab.errors import UserError

    other = tiny_target()
    d = trained["domino", True]
    for decode in (lambda: speculative_generate(other, d, prompt_ids=[5, 6], max_new_tokens=2),
                   lambda: speculative_generate(other, d, prompt_ids=[5, 6], max_new_tokens=2, tree_nodes=4),
                   lambda: batched_generate(other, d, [[5, 6]], max_new_tokens=2)):
        with pytest.raises(UserError, match="bound to another Target object"):
            decode()


# ---- batched decoding of a queue: finished rows hand their slots to waiting prompts ----------------------------
@pytest.mark.parametrize("method, drafts", [(None, "all"), ("domino", "all"), ("domino", "adaptive"), ("domino", 2),
                                           ("dflash", "all"), ("dflash", "adaptive"), ("anchor", "all")])
def test_a_queue_of_prompts_decodes_each_as_alone(target, plain, trained, method, drafts, monkeypatch):
    """With fewer slots than prompts, a finished row's place in the caches goes to the next prompt (columns no live
    row needs are trimmed, here once 4 are free; the caches widen for a long prompt) and every prompt still equals
    its own greedy decoding; no forward ever holds more rows than the slots."""
    from domino_lab.decoding import batched

    monkeypatch.setattr(batched, "TRIM_COLUMNS", 4)
    d = trained[method, True] if method in ("domino", "dflash") else None
    if method == "anchor":                  # reads the feature before its anchor: new rows wait for the next draft
        d = Drafter.untrained(target, "dflash", seed=4, block_size=4, anchor_feature=True)
    # the last prompt is longer than the batch's cache by the time it gets a row: the caches widen for it
    prompts = PROMPTS[:12] + [[(5 * j) % 60 + 4 for j in range(40)]]
    refs = [plain[tuple(p)] for p in prompts[:-1]]
    refs.append(speculative_generate(target, None, prompt_ids=prompts[-1], max_new_tokens=24).token_ids)
    rows = []
    forward = target.forward
    monkeypatch.setattr(target, "forward", lambda ids, **kw: rows.append(ids.shape[0]) or forward(ids, **kw))
    for slots in (1, 3, 5):
        rows.clear()
        res = batched.batched_generate(target, d, prompts, max_new_tokens=24, drafts=drafts, slots=slots)
        assert res.token_ids == refs, (method, drafts, slots)
        assert max(rows) <= slots
        if method in ("domino", "dflash") and drafts != 2:
            assert max(a for row in res.acceptance_lengths for a in row) > 1      # drafts were accepted
        if d is not None and drafts == "all":
            # a row's drafts read only its own context, whoever shares the batch: its steps match its decode alone
            alone = [batched.batched_generate(target, d, [p], max_new_tokens=24, drafts="all").acceptance_lengths[0]
                     for p in prompts]
            assert res.acceptance_lengths == alone, slots


def test_a_draft_after_plain_steps_takes_in_its_context_compacted(target, plain, trained, monkeypatch):
    """Plain steps leave their positions pending, one chunk per step, and a prompt that joins holds nothing in the
    older chunks: the draft that follows takes them in compacted (each row's positions right-aligned, columns no row
    needs dropped). The drafts are those of the padded chunks (the same acceptance, step for step), and every prompt
    still equals its own decoding."""
    from domino_lab.decoding import batched
    from domino_lab.decoding.adaptive import DraftCount

    class Scripted(DraftCount):            # runs of plain steps between drafting steps, the same in every decode
        def __init__(self, n_max):
            super().__init__(n_max)
            self.script = iter([0, 0, 0, 4, 0, 4, 4, 0, 0] * 20)

        def choose(self, rows, room, pending=0):
            return min(next(self.script), room)

    monkeypatch.setattr(batched, "DraftCount", Scripted)
    prompts = PROMPTS[:10]
    widths = []

    def spy(feats, valid, pos):
        out = compact(feats, valid, pos)
        widths.append((valid.shape[1], out[1].shape[1]))
        return out

    d = trained["domino", True]
    drafts = []
    draft = d.draft
    monkeypatch.setattr(d, "draft", lambda *a, **kw: (r := draft(*a, **kw), drafts.append(r.base_topk))[0])
    compact = batched.compact
    monkeypatch.setattr(batched, "compact", spy)
    res = batched.batched_generate(target, d, prompts, 24, drafts="adaptive", slots=3)
    assert res.token_ids == [plain[tuple(p)] for p in prompts]
    assert any(after < before for before, after in widths), widths
    compacted, drafts = drafts, []
    monkeypatch.setattr(batched, "compact", lambda feats, valid, pos: (feats, valid, pos))
    padded = batched.batched_generate(target, d, prompts, 24, drafts="adaptive", slots=3)
    assert padded.acceptance_lengths == res.acceptance_lengths
    assert len(drafts) == len(compacted)
    for (ids_a, logits_a), (ids_b, logits_b) in zip(drafts, compacted):    # every slot's top drafts, their logits
        assert torch.equal(ids_a, ids_b)
        torch.testing.assert_close(logits_a, logits_b, rtol=1e-4, atol=1e-4)


def test_compact_right_aligns_each_rows_context():
    from domino_lab.decoding.batched import compact

    valid = torch.tensor([[1, 0, 1, 0, 0, 1], [0, 0, 0, 0, 1, 0], [0, 1, 1, 0, 1, 0]], dtype=torch.bool)
    pos = torch.arange(6).expand(3, -1) + 10 * torch.arange(3)[:, None]
    feats = pos[..., None].float().expand(-1, -1, 2)
    f, v, p = compact(feats, valid, pos)
    assert v.tolist() == [[True] * 3, [False, False, True], [True] * 3]
    assert p[v].tolist() == pos[valid].tolist()                   # each row's positions, in order
    assert torch.equal(f[..., 0], p.float()) and f.shape == (3, 3, 2)
    full = torch.ones(2, 4, dtype=torch.bool)
    assert compact(feats[:2, :4], full, pos[:2, :4])[1] is full   # nothing to drop: unchanged


def test_slots_must_be_a_positive_whole_number(target):
    from domino_lab.decoding.batched import batched_generate
    from domino_lab.errors import UserError

    for bad in (0, -2, 1.5, True):
        with pytest.raises(UserError, match="slots"):
            batched_generate(target, None, PROMPTS[:2], 4, slots=bad)


def test_take_in_fills_the_draft_cache_as_a_draft_does(target, trained):
    """A drafter taking in a context by itself (a queue's new rows) leaves the same draft cache as a draft that
    takes it in, so the rows' later drafts are the same."""
    from domino_lab.decoding.kv_cache import new_cache

    d = trained["domino", True]
    ids = torch.tensor([PROMPTS[4], PROMPTS[9][:len(PROMPTS[4])]])
    out = target.forward(ids, taps=d.config.target_layer_ids)
    n, c = ids.shape
    pos = torch.arange(c).expand(n, -1)
    anchor, start = ids[:, -1], torch.full((n,), c)
    key_valid = torch.ones(n, c + d.config.block_size, dtype=torch.bool)
    a, b = new_cache(), new_cache()
    d.draft(out.features, pos, anchor, start, a, key_valid=key_valid)
    d.take_in(out.features, pos, anchor, start, b, key_valid=key_valid)
    for la, lb in zip(a.layers, b.layers, strict=True):
        torch.testing.assert_close(la.keys, lb.keys)
        torch.testing.assert_close(la.values, lb.values)
