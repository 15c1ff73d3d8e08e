"""Linear layers through oneDNN's packed weights (models/packed_linear.py): the same products as F.linear to
rounding, the same greedy text under every mode, and nothing a module's users could notice but the time."""
import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from domino_lab import Target, speculative_generate
from domino_lab.data.eval_sets import load_eval_set
from domino_lab.errors import UserError
from domino_lab.models import load_drafter
from domino_lab.models import packed_linear as pl

needs_onednn = pytest.mark.skipif(not pl.available(), reason="this torch build has no oneDNN linear")


@pytest.fixture(autouse=True)
def restore_mode():
    before = pl.mode()
    yield
    pl.set_mode(before)


def packed_copy(lin: nn.Linear) -> nn.Linear:
    p = copy.deepcopy(lin)
    assert pl.use_packed(p) == 1 and type(p) is pl.PackedLinear
    return p


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 256), (8, 256), (1, 9, 256), (2, 33, 256), (64, 256)])
def test_packed_products_equal_aten_products_to_rounding(bias, shape):
    torch.manual_seed(0)
    lin = nn.Linear(256, 768, bias=bias)
    p = packed_copy(lin)
    x = torch.randn(*shape)
    with torch.no_grad():
        ref = lin(x)
        for m in ("onednn", "auto", "aten"):
            pl.set_mode(m)
            out = p(x)
            assert out.shape == ref.shape
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            assert torch.equal(out, ref) or m != "aten"        # aten is F.linear itself
        # a non-contiguous input (a transposed view) reads the same values
        pl.set_mode("onednn")
        xt = torch.randn(shape[-1], *shape[:-1]).movedim(0, -1)
        torch.testing.assert_close(p(xt), lin(xt), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_a_changed_weight_is_packed_again():
    pl.set_mode("onednn")
    lin = nn.Linear(64, 32, bias=False)
    p = packed_copy(lin)
    x = torch.randn(8, 64)
    with torch.no_grad():
        first = p(x)
        p.weight.mul_(2.0)                  # an optimiser step or a load_state_dict changes the weight in place
        torch.testing.assert_close(p(x), 2 * first, rtol=1e-5, atol=1e-5)
        p.weight.data = torch.randn(32, 64)   # new storage
        torch.testing.assert_close(p(x), F.linear(x, p.weight), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_no_packed_copy_where_it_would_crowd_the_memory(monkeypatch):
    """A copy doubles its weight's memory: where making it would leave less than RESERVE of the machine's memory
    available, the weight keeps MKL's product (exactly F.linear), and it is packed once there is room again."""
    pl.set_mode("onednn")
    lin = nn.Linear(64, 32, bias=True)
    p = packed_copy(lin)
    x = torch.randn(8, 64)
    nbytes = lin.weight.numel() * 4
    total = 1 << 30
    # just too little room: what would stay available after the copy is one byte short of the reserve
    monkeypatch.setattr(pl, "memory", lambda: (int(pl.RESERVE * total) + nbytes - 1, total))
    with torch.no_grad():
        assert torch.equal(p(x), F.linear(x, lin.weight, lin.bias))
        assert pl._packed[p.weight][2] is None
        monkeypatch.setattr(pl, "memory", lambda: (int(pl.RESERVE * total) + nbytes, total))
        p.weight.mul_(1.0)                  # a new version: judged again, now with room
        out = p(x)
        assert pl._packed[p.weight][2] is not None
        torch.testing.assert_close(out, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(pl, "memory", lambda: None)        # memory unknown (not Linux): copies are made
    assert pl._room_for(1 << 62)


def test_memory_reads_this_machine():
    from pathlib import Path

    m = pl.memory()
    if not Path("/proc/meminfo").exists():        # not Linux: memory unknown, and copies are made (above)
        assert m is None
        return
    avail, total = m
    assert 0 < avail <= total


@needs_onednn
def test_training_and_other_dtypes_take_aten():
    pl.set_mode("onednn")
    p = packed_copy(nn.Linear(16, 8))
    x = torch.randn(4, 16, requires_grad=True)
    y = p(x)                                # autograd records it: F.linear, with its gradient
    assert y.grad_fn is not None
    y.sum().backward()
    assert x.grad is not None and p.weight.grad is not None
    d = packed_copy(nn.Linear(16, 8)).double()
    with torch.no_grad():
        assert d(torch.randn(4, 16, dtype=torch.float64)).dtype == torch.float64


@needs_onednn
def test_modules_that_used_packed_weights_copy_pickle_and_save_as_before():
    pl.set_mode("onednn")
    lin = nn.Linear(32, 16)
    p = packed_copy(lin)
    with torch.no_grad():
        p(torch.randn(8, 32))               # packs its weight (oneDNN's tensor cannot be copied or pickled)
    assert list(p.state_dict()) == list(lin.state_dict())
    q = copy.deepcopy(p)
    r = pickle.loads(pickle.dumps(p))
    x = torch.randn(8, 32)
    with torch.no_grad():
        for other in (q, r):
            torch.testing.assert_close(other(x), p(x), rtol=1e-5, atol=1e-5)


def test_use_packed_swaps_plain_linears_only_and_keeps_ties():
    class Custom(nn.Linear):
        pass

    m = nn.Module()
    m.embed = nn.Embedding(10, 4)
    m.head = nn.Linear(4, 10, bias=False)
    m.head.weight = m.embed.weight
    m.custom = Custom(4, 4)
    m.block = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    assert pl.use_packed(m) == 2
    assert type(m.head) is pl.PackedLinear and type(m.block[0]) is pl.PackedLinear and type(m.custom) is Custom
    assert m.head.weight is m.embed.weight
    assert pl.use_packed(m) == 0            # already swapped


@needs_onednn
def test_auto_measures_each_weight_shape_once():
    pl.set_mode("auto")
    w = torch.randn(96, 48)
    pl._min_rows.pop((96, 48, False), None)
    first = pl.min_rows(w, None)
    allowed = {r + 1 for r in (0, *pl.TIMING_ROWS[:-1])} | {pl.NEVER}
    assert first in allowed
    pl._min_rows[(96, 48, False)] = 5       # a kept choice is read, not measured again
    assert pl.min_rows(torch.randn(96, 48), None) == 5
    pl._min_rows.pop((96, 48, False))
    pl.set_mode("aten")
    assert pl.min_rows(w, None) == pl.NEVER


def test_a_bad_mode_is_one_clear_error_before_decoding(monkeypatch):
    monkeypatch.setattr(pl, "_mode", None)
    monkeypatch.setenv(pl.ENV, "fast")
    with pytest.raises(UserError, match="DOMINO_LAB_LINEARS='fast' is not a linear kernel mode; set it to one of"):
        Target.from_pretrained("default")
    with pytest.raises(ValueError, match="unknown linear kernel mode"):
        pl.set_mode("mkl")


@pytest.fixture(scope="module")
def target_and_drafter():
    t = Target.from_pretrained("default")
    return t, load_drafter("default", t)


@needs_onednn
@pytest.mark.parametrize("mode", ["onednn", "auto", "aten"])
def test_greedy_decoding_is_lossless_under_every_mode(target_and_drafter, mode):
    t, d = target_and_drafter
    pl.set_mode(mode)
    assert type(t.lm_head) is pl.PackedLinear and t.screen is not None     # the head screen still applies
    for name in ("humaneval", "unseen"):
        for row in load_eval_set(name)[:2]:
            plain = speculative_generate(t, None, prompt=row["prompt"], max_new_tokens=40).token_ids
            for nodes in (0, 16):
                spec = speculative_generate(t, d, prompt=row["prompt"], max_new_tokens=40, tree_nodes=nodes)
                assert spec.token_ids == plain, (mode, name, nodes)


def test_the_experiment_times_products_and_pairs_decodes_per_prompt(tmp_path):
    import json
    import math

    from core_helpers import experiment_script

    before = pl.mode()
    out = tmp_path / "pl"
    assert experiment_script("packed_linears").main(["--quick", "--threads", "1", "--out", str(out)]) == 0
    assert pl.mode() == before                          # the experiment leaves the process's mode as it found it
    res = json.loads((out / "packed_linears.json").read_text())
    assert "256 × 256" in res["products"] and "8192 × 256" in res["products"]
    assert all(v > 0 for t in res["products"].values() for r in t.values() for v in r.values())
    math_set = res["decoding"]["math"]
    assert set(math_set) == {"ar", "domino", "dflash", "domino-tree"}
    for c, r in math_set.items():
        assert r["lossless"] == r["decodes"] == 1
        a, b = (r["per_prompt_tokens_per_s"][m] for m in ("aten", "auto"))
        assert r["auto_over_aten"]["geomean"] == pytest.approx(math.exp(sum(math.log(y / x) for x, y in zip(a, b))
                                                                        / len(a)))
    md = (out / "packed_linears.md").read_text()
    assert "| 256 × 256 | " in md and "| math | domino-tree |" in md


def test_a_target_can_keep_its_plain_linear_layers():
    t = Target.from_pretrained("default", packed_linears=False)
    assert type(t.lm_head) is nn.Linear and t.screen is not None
    assert not any(isinstance(m, pl.PackedLinear) for m in t.model.modules())


def test_every_drafter_is_built_with_packed_linears_and_still_trains():
    t = Target.from_pretrained("default")
    from domino_lab import Drafter

    d = Drafter.untrained(t, "dflash")
    lins = [m for m in d.modules() if isinstance(m, nn.Linear)]
    assert lins and all(type(m) is pl.PackedLinear for m in lins)
    x = torch.randn(2, 8, d.config.hidden_size)
    out = d.backbone.layers[0].mlp(x)        # autograd records the call: the gradient reaches the weights
    out.sum().backward()
    assert d.backbone.layers[0].mlp.up_proj.weight.grad is not None


@needs_onednn
def test_weights_made_under_inference_mode_are_packed_too():
    pl.set_mode("onednn")
    with torch.inference_mode():             # inference tensors keep no version counter
        lin = nn.Linear(32, 16)
        x = torch.randn(8, 32)
    assert pl.use_packed(lin) == 1
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
