"""The LM-head screen: greedy tokens from a half-precision copy of the head must be the float32 head's argmax."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from domino_lab import Target, speculative_generate
from domino_lab.data.eval_sets import load_eval_set
from domino_lab.decoding.batched import batched_generate
from domino_lab.head_screen import ArgmaxScreen
from domino_lab.models import load_drafter


@pytest.fixture(scope="module")
def targets():
    return Target.from_pretrained("default", head_screen=True), Target.from_pretrained("default", head_screen=False)


@pytest.fixture(scope="module")
def hidden(targets):
    """Final-normed states of the embedded target over real prompts: what the screen sees when decoding."""
    t = targets[0]
    rows = []
    for name in ("math", "humaneval", "unseen"):
        for r in load_eval_set(name)[:3]:
            out = t.model.get_decoder()(input_ids=torch.tensor([t.encode(r["prompt"])]))
            rows.append(out.last_hidden_state[0])
    return torch.cat(rows)


def test_the_embedded_target_is_screened_and_other_heads_are_not(targets):
    assert targets[0].screen is not None and targets[1].screen is None
    assert ArgmaxScreen.for_head(nn.Linear(8, 16, bias=False)) is not None
    assert ArgmaxScreen.for_head(nn.Linear(8, 16, bias=True)) is None               # a bias: not a plain product
    assert ArgmaxScreen.for_head(nn.Linear(8, 16, bias=False).double()) is None     # nothing to halve from float64
    assert ArgmaxScreen.for_head(nn.Linear(8, 16, bias=False).bfloat16()) is None   # already half the bytes
    moved = Target.from_pretrained("default")
    assert moved.screen is not None
    moved.model.double()                          # new weight storage: the screen follows the head as it is now
    assert moved.screen is None
    p = moved.encode("def add(a, b):")
    hf = moved.model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              do_sample=False, max_new_tokens=8, pad_token_id=0)[0, len(p):].tolist()
    assert speculative_generate(moved, None, prompt_ids=p, max_new_tokens=8).token_ids == hf


def test_screen_argmax_is_the_float32_heads(targets, hidden):
    screen = targets[0].screen
    w = targets[0].lm_head.weight
    g = torch.Generator().manual_seed(0)
    cases = [hidden, hidden * 7, torch.randn(300, w.shape[1], generator=g) * 3]
    for h in cases:
        want = F.linear(h, w).argmax(-1)
        assert torch.equal(screen.argmax(h), want)                          # many rows at once (bfloat16 copy)
        for i in range(0, len(h), 37):                                       # one row at a time (float16 copy)
            assert int(screen.argmax(h[i])) == int(want[i])


def test_close_calls_are_decided_in_float32(targets, hidden):
    """Rows whose two best logits are closer than half precision can resolve: the copy alone gets some of them
    wrong (so this test would catch a screen that trusted it); the screen recomputes them and gets every one."""
    screen = targets[0].screen
    w = targets[0].lm_head.weight
    rows, half_wrong = [], 0
    for i in range(0, len(hidden), 3):
        h = hidden[i]
        logits = F.linear(h, w)
        a, b = logits.topk(2).indices
        d = w[a] - w[b]
        # move h along w_a - w_b until the two logits are 1e-3 apart, either way round
        for gap in (1e-3, -1e-3):
            h2 = h - d * ((logits[a] - logits[b] - gap) / d.dot(d))
            rows.append(h2)
    h = torch.stack(rows)
    want = F.linear(h, w).argmax(-1)
    for dtype in (torch.bfloat16, torch.float16):
        half_wrong += int((F.linear(h.to(dtype), w.to(dtype)).float().argmax(-1) != want).sum())
    assert half_wrong > 0
    assert torch.equal(screen.argmax(h), want)
    assert all(int(screen.argmax(r)) == int(x) for r, x in zip(h[::5], want[::5]))


def test_greedy_decoding_with_the_screen_equals_the_full_head(targets):
    """Plain, chain, tree and batched decoding of the screened target equal the full head's plain decoding and
    Hugging Face's greedy generate, on prompts from three sets."""
    screened, full = targets
    drafter = load_drafter("default", screened)
    prompts = [screened.encode(r["prompt"]) for name in ("math", "humaneval", "unseen")
               for r in load_eval_set(name)[:2]]
    refs = []
    for p in prompts:
        ref = speculative_generate(full, None, prompt_ids=p, max_new_tokens=48).token_ids
        hf = full.model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 do_sample=False, max_new_tokens=48, pad_token_id=0)[0, len(p):].tolist()
        assert hf[: len(ref)] == ref
        assert speculative_generate(screened, None, prompt_ids=p, max_new_tokens=48).token_ids == ref
        assert speculative_generate(screened, drafter, prompt_ids=p, max_new_tokens=48).token_ids == ref
        assert speculative_generate(screened, drafter, prompt_ids=p, max_new_tokens=48,
                                    tree_nodes=16).token_ids == ref
        refs.append(ref)
    assert batched_generate(screened, drafter, prompts, 48).token_ids == refs


def test_auto_screen_is_used_where_timing_says_it_is_the_faster_read(monkeypatch):
    """head_screen="auto" (the default) times the screen against the full head once per kind of call (one row,
    2-16 rows, more) and reads greedy tokens through the faster; either way they are the full head's argmax."""
    import time as clock

    from domino_lab import head_screen
    from domino_lab.models.packed_linear import mode

    m = mode()                              # (decisions are per linear kernel mode: the full read depends on it)
    t = Target.from_pretrained("default")
    full = Target.from_pretrained("default", head_screen=False)
    h = torch.randn(9, t.hidden_size, generator=torch.Generator().manual_seed(0)) * 3
    want = full.greedy_tokens(h)
    screen, real = t.screen, head_screen.ArgmaxScreen.argmax

    def slow(self, x):                      # a screen far slower than any full read
        t0 = clock.thread_time()
        while clock.thread_time() - t0 < 0.02:
            pass
        return real(self, x)
    monkeypatch.setattr(head_screen.ArgmaxScreen, "argmax", slow)
    assert torch.equal(t.greedy_tokens(h), want) and screen._pays == {(2, m): False}
    assert torch.equal(t.greedy_tokens(h[:1]), want[:1]) and screen._pays == {(2, m): False, (1, m): False}
    # a screen that costs nothing: used for the kind of call not timed yet, and the decisions taken stand
    answers = {len(x): real(screen, x) for x in (h[:1], h, h.repeat(3, 1))}
    monkeypatch.setattr(head_screen.ArgmaxScreen, "argmax",
                        lambda self, x: answers[x.reshape(-1, x.shape[-1]).shape[0]])
    assert torch.equal(t.greedy_tokens(h.repeat(3, 1)), want.repeat(3)) and screen._pays[3, m] is True
    assert screen.pays(h) is False and screen.pays(h[:1]) is False
    forced = Target.from_pretrained("default", head_screen=True)      # True: always the screen, never timed
    assert torch.equal(forced.greedy_tokens(h), want) and forced.screen._pays == {}
    with pytest.raises(ValueError, match="head_screen"):
        Target.from_pretrained("default", head_screen="yes")


def test_head_screen_experiment_quick(tmp_path):
    """experiments/head_screen.py end to end at its smallest: every decoder with and without the screen, and the
    outputs checked against the full head's plain decoding."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "experiments" / "head_screen.py"
    spec = importlib.util.spec_from_file_location("head_screen_experiment", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--quick", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "head_screen.json").read_text())
    assert set(res["head_ms"]) == {"1", "9", "33"} and set(res["candidates"]) == {"float16", "bfloat16"}
    assert 0 < res["candidates"]["float16"]["one"] <= 1
    rows = res["decoding"]["math"]
    assert set(rows) == {"ar", "domino", "domino-tree"}
    assert all(v["lossless"] == {"full": 1, "screen": 1} and v["speedup"] > 0 for v in rows.values())
    assert "| math | domino-tree |" in (tmp_path / "head_screen.md").read_text()


def test_the_screen_is_timed_again_under_another_linear_kernel_mode(monkeypatch):
    """The full head the screen competes with is oneDNN's packed product or MKL's (models/packed_linear.py): a
    decision taken under one mode does not stand for the other."""
    from domino_lab.models import packed_linear as pl

    before = pl.mode()
    t = Target.from_pretrained("default")
    h = torch.randn(9, t.hidden_size, generator=torch.Generator().manual_seed(1))
    try:
        for m in ("aten", "auto"):
            pl.set_mode(m)
            t.greedy_tokens(h)
        assert set(t.screen._pays) == {(2, "aten"), (2, "auto")}
    finally:
        pl.set_mode(before)


def test_with_several_threads_the_screen_is_timed_by_the_wall_clock(monkeypatch):
    """With several torch threads a product runs partly on threads that the calling thread's CPU clock does not
    see: a read whose time is spent off the calling thread (a sleep, here) must still count as slow."""
    import time as clock

    from domino_lab import head_screen

    t = Target.from_pretrained("default")
    h = torch.randn(9, t.hidden_size, generator=torch.Generator().manual_seed(2))
    want = Target.from_pretrained("default", head_screen=False).greedy_tokens(h)
    answer = head_screen.ArgmaxScreen.argmax(t.screen, h)

    def off_thread(self, x):                # no CPU time on the calling thread, 20 ms of wall time
        clock.sleep(0.02)
        return answer
    monkeypatch.setattr(head_screen.ArgmaxScreen, "argmax", off_thread)
    monkeypatch.setattr(head_screen.torch, "get_num_threads", lambda: 2)
    assert torch.equal(t.greedy_tokens(h), want)
    assert list(t.screen._pays.values()) == [False]


def test_a_plain_step_keeps_the_screen_unless_the_full_head_is_clearly_faster():
    """One-row calls keep the screen up to ONE_ROW_MARGIN of the full head's time (it reads half the bytes, which a
    timing of the head alone does not credit); verify rows need it below MARGIN."""
    import time as clock

    from domino_lab import head_screen

    def busy(ms):
        t0 = clock.thread_time()
        while clock.thread_time() - t0 < ms / 1e3:
            pass

    w = torch.randn(64, 16)
    for screen_ms, one_row, nine_rows in ((2.1, True, False), (2.6, False, False), (1.4, True, True)):
        s = head_screen.ArgmaxScreen(w, full=lambda h: (busy(2.0), h @ w.T)[1])
        s.argmax = lambda h, ms=screen_ms: (busy(ms), torch.zeros(h.shape[0], dtype=torch.long))[1]
        assert s.pays(torch.randn(1, 16)) is one_row, screen_ms
        assert s.pays(torch.randn(9, 16)) is nine_rows, screen_ms
