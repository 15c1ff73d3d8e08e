"""The decoders' growing K/V cache: the same contents as Hugging Face's DynamicCache under every operation the
decoders apply, written in place while there is room, and the same decoded tokens and steps."""
import random

import pytest
import torch
from transformers import DynamicCache, Qwen3Config, Qwen3NextConfig
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

from domino_lab.decoding import kv_cache
from domino_lab.decoding import tree as trees
from domino_lab.decoding.batched import batched_generate
from domino_lab.errors import UserError


def _same(a, b):
    assert a.get_seq_length() == b.get_seq_length()
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


@pytest.mark.parametrize("seed", range(4))
def test_growing_layer_matches_dynamic_cache_under_every_operation(seed):
    """Random updates, crops, tree compactions and batch selections, applied to both caches: equal contents (and
    equal tensors returned to attention) after every operation."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    ours, ref = kv_cache.new_cache(), DynamicCache()
    batch = 5
    for _ in range(120):
        n = ref.get_seq_length()
        op = rng.choice(["update"] * 4 + ["crop", "compact", "select"])
        if op == "update" or n == 0:
            q = rng.choice([1, 1, 2, 9, 33, 70])
            for layer in range(2):
                k, v = torch.randn(2, batch, 2, q, 4, generator=g)
                got, want = ours.update(k, v, layer), ref.update(k.clone(), v.clone(), layer)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        elif op == "crop":
            cut = rng.randint(1, n)
            ours.crop(-cut), ref.crop(-cut)
        elif op == "compact":
            prefix = rng.randint(0, n - 1)
            rows = sorted(rng.sample(range(n - prefix), rng.randint(1, n - prefix)))
            trees.compact_cache(ours, prefix, rows), trees.compact_cache(ref, prefix, rows)
        elif batch > 1:
            # rows that finish leave the batch; a reordering keeps the shape but not the contents
            sel = torch.tensor(rng.sample(range(batch), rng.choice([batch, rng.randint(1, batch)])))
            batch = len(sel)
            ours.batch_select_indices(sel), ref.batch_select_indices(sel)
        _same(ours, ref)
    assert all(type(layer) is kv_cache.GrowingLayer for layer in ours.layers)


def test_growing_layer_writes_in_place_until_it_is_full():
    cache = kv_cache.new_cache()
    k = torch.zeros(1, 2, 10, 4)
    cache.update(k, k, 0)
    layer = cache.layers[0]
    buf, room = layer._k.data_ptr(), layer._k.shape[-2]
    assert room >= 10 + kv_cache.MIN_ROOM
    for _ in range(room - 10):                      # one-token steps fill the buffer without a new allocation
        cache.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4), 0)
        assert layer._k.data_ptr() == buf
    cache.crop(-5)                                  # a crop narrows the view: the next step writes in place
    cache.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4), 0)
    assert layer._k.data_ptr() == buf and cache.get_seq_length() == room - 2
    cache.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4), 0)      # full: a larger buffer, contents kept
    assert layer._k.data_ptr() != buf and layer._k.shape[-2] > room
    assert cache.get_seq_length() == room + 1 and layer.keys[..., :10, :].abs().sum() == 0
    cache.reset()
    assert cache.get_seq_length() == 0


def test_a_capacity_hint_sizes_the_buffer_once():
    cache = kv_cache.new_cache(capacity=40)
    x = torch.zeros(2, 2, 10, 4)
    cache.update(x, x, 0)
    layer = cache.layers[0]
    assert layer._k.shape[-2] == 40
    buf = layer._k.data_ptr()
    cache.update(torch.zeros(2, 2, 30, 4), torch.zeros(2, 2, 30, 4), 0)         # exactly full: same buffer
    assert layer._k.data_ptr() == buf
    cache.batch_select_indices(torch.tensor([1]))      # a new batch: a new buffer, at the hinted size again
    cache.update(x[:1, :, :0], x[:1, :, :0], 0)
    assert layer._k.shape[-2] == 40 and layer._k.shape[0] == 1
    cache.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4), 0)              # past the hint: it grows
    assert layer._k.shape[-2] >= 41 + kv_cache.MIN_ROOM and cache.get_seq_length() == 41


@pytest.mark.parametrize("nodes", [0, 16])
def test_a_decode_allocates_each_buffer_once(shipped, monkeypatch, nodes):
    """The batch-1 engine's capacity hints cover the whole decode: every buffer is allocated at the hinted size,
    none grown past it."""
    from domino_lab import speculative_generate

    target, drafter, prompts = shipped
    grown = []
    reallocate = kv_cache.GrowingLayer._reallocate

    def spy(self, keys, values, new):
        reallocate(self, keys, values, new)
        grown.append(self._k.shape[-2] != self.capacity)   # a buffer past the hint (rows leaving a batch: at it)

    monkeypatch.setattr(kv_cache.GrowingLayer, "_reallocate", spy)
    for p in prompts:
        speculative_generate(target, drafter, prompt_ids=p, max_new_tokens=60, tree_nodes=nodes)
    assert grown and not any(grown)


@pytest.mark.parametrize("seed", range(3))
def test_window_layer_keeps_the_window_through_a_chains_updates_and_crops(seed):
    """A chain's forwards (a long prompt, then verifies of 1–9 tokens, each cut back by up to all its tokens) on a
    window layer and on a full one: the window layer hands attention the same last positions the full one ends in,
    keeps W − 1 before the latest forward, reports the true length and its offset, and stays window-sized."""
    rng, g, w, room = random.Random(seed), torch.Generator().manual_seed(seed), 7, 8
    ours, ref = kv_cache.WindowLayer(w, room), kv_cache.GrowingLayer()
    for step in range(200):
        q = rng.choice([40, 300]) if step == 0 else rng.randint(1, 9)
        kept = ours.keys.shape[-2] if step else 0
        assert ours.get_mask_sizes(q) == (kept + q, ref.get_seq_length() - kept)
        k, v = torch.randn(2, 1, 2, q, 4, generator=g)
        got, want = ours.update(k, v), ref.update(k.clone(), v.clone())
        assert torch.equal(got[0], want[0][..., -(kept + q):, :]) and torch.equal(got[1], want[1][..., -(kept + q):, :])
        assert ours.keys.shape[-2] == min(w - 1 + q, ref.get_seq_length())
        cut = rng.randint(0, q)
        ours.crop(-cut), ref.crop(-cut)
        n = ours.keys.shape[-2]
        assert ours.get_seq_length() == ref.get_seq_length() and n >= min(w - 1, ref.get_seq_length())
        assert torch.equal(ours.keys, ref.keys[..., -n:, :]) and torch.equal(ours.values, ref.values[..., -n:, :])
        if step > 1:
            assert ours._k.shape[-2] <= 4 * (w - 1 + room)        # the prompt's large buffer is gone
    with pytest.raises(RuntimeError, match="window would reach dropped positions"):
        ours.crop(-(ours.keys.shape[-2] - w + 2))
    ours.reset()
    assert ours.get_seq_length() == 0


def _one_layer(layer) -> DynamicCache:
    cache = DynamicCache()
    cache.layers = [layer]
    return cache


@pytest.mark.parametrize("seed", range(3))
def test_rows_window_layer_holds_every_rows_window_through_a_batchs_operations(seed):
    """A batch's window layer against a full one under what batched decoding does: verifies whose rejected drafts
    stay as holes (cropped where every row rejected them), rows handed to new prompts (right-aligned, longer ones
    widening the batch), leading columns trimmed. After each, every row's window (its positions from the next
    query's − W + 1 on) is held and equal to the full layer's, and the layer ends holding far fewer columns."""
    rng, g, w, rows = random.Random(seed), torch.Generator().manual_seed(seed), 5, 3

    def prefill(lens):
        n = max(lens)
        valid = torch.arange(n)[None] >= (n - torch.tensor(lens))[:, None]
        k, v = torch.randn(2, len(lens), 1, n, 2, generator=g)
        a, b = _one_layer(kv_cache.RowsWindowLayer(w)), _one_layer(kv_cache.GrowingLayer())
        a.update(k, v, 0), b.update(k.clone(), v.clone(), 0)
        return a, b, valid

    def verify(keep: list[int], least: int):
        nonlocal valid, start
        k = max(keep) + rng.randint(0, 2)
        kk, vv = torch.randn(2, len(keep), 1, k, 2, generator=g)
        ours.update(kk, vv, 0), ref.update(kk.clone(), vv.clone(), 0)
        keep = torch.tensor(keep)
        valid = torch.cat([valid, torch.arange(k)[None] < keep[:, None]], dim=1)
        cut = k - int(keep.max())
        if cut:
            ours.crop(-cut), ref.crop(-cut)
            valid = valid[:, :-cut]
        start = start + keep
        kv_cache.drop_outside_windows(ours, valid, start, least=least)

    def join(r: int, n: int):
        nonlocal valid
        a, b, v_new = prefill([n])
        ours_valid = kv_cache.place_rows(ours, valid.clone(), a, v_new, torch.tensor([r]))
        valid = kv_cache.place_rows(ref, valid, b, v_new, torch.tensor([r]))
        assert torch.equal(ours_valid, valid)
        start[r] = n

    def check():
        mine, full = ours.layers[0], ref.layers[0]
        assert mine.offset + mine.held() == full.keys.shape[-2] == valid.shape[1] == ours.get_seq_length()
        pos = valid.long().cumsum(-1) - 1
        for r in range(valid.shape[0]):
            need = [c for c in range(valid.shape[1]) if valid[r, c] and pos[r, c] > start[r] - w]
            assert need and min(need) >= mine.offset
            at = torch.tensor(need)
            assert torch.equal(mine.keys[r, :, at - mine.offset], full.keys[r, :, at])
            assert torch.equal(mine.values[r, :, at - mine.offset], full.values[r, :, at])
        return mine, full

    ours, ref, valid = prefill([rng.randint(1, 12) for _ in range(rows)])
    start, dropped = valid.sum(1), 0
    for _ in range(150):
        op = rng.random()
        if op < 0.7:                                            # a verify, each row keeping some of its tokens
            verify([rng.randint(1, 6) for _ in range(rows)], least=rng.choice([1, 3, 8]))
        elif op < 0.9:                                          # a finished row takes a new prompt
            join(rng.randrange(rows), rng.randint(1, 40))
        else:
            before, valid = valid, kv_cache.trim_left(ours, valid, 1)      # (leading columns no row holds)
            assert torch.equal(kv_cache.trim_left(ref, before, 1), valid)
        mine, full = check()
        dropped = max(dropped, mine.offset)
    assert dropped > 0 and mine.held() < full.keys.shape[-2]
    # rows that all joined recently leave fewer than W - 1 columns held; a longer prompt joining gets its window
    ours, ref, valid = prefill([1, 1])
    start = valid.sum(1)
    verify([6, 6], least=1)
    join(0, 1), join(1, 1)
    verify([1, 1], least=1)
    assert ours.layers[0].held() < w - 1
    join(0, 10)
    assert check()[0].held() == w - 1


def test_linear_attention_layers_count_a_batchs_columns_through_its_operations():
    """Qwen3-Next's first layer is a linear-attention one, so the cache's length is what those layers count; a batch's
    operations keep it at the K/V layers' column count (what the model's own positions would start from)."""
    from transformers import Qwen3NextForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3NextConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=8, intermediate_size=32, mlp_only_layers=[0, 1],
                          linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
                          linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"])
    model = Qwen3NextForCausalLM(cfg).eval()

    def prefill(rows: int, n: int):
        cache = kv_cache.new_cache(cfg)
        with torch.no_grad():
            model(input_ids=torch.randint(4, 32, (rows, n)), cache=cache, use_cache=True)
        return cache

    def columns(cache):
        return cache.layers[1].keys.shape[-2]

    cache = kv_cache.stack_rows([prefill(2, 5), prefill(1, 7)])
    assert columns(cache) == int(cache.get_seq_length()) == 7
    kv_cache.record_past(cache, 4)
    with torch.no_grad():
        model(input_ids=torch.randint(4, 32, (3, 4)), cache=cache, use_cache=True,
              position_ids=torch.arange(7, 11).expand(3, -1))
    kv_cache.cut_back_rows(cache, 4, torch.tensor([3, 1, 2]), cut=1)
    assert columns(cache) == int(cache.get_seq_length()) == 10
    assert cache.layers[0].conv_states[0].shape[-1] == cache.layers[0].conv_kernel_size[0]
    kv_cache.widen(cache, 3)
    assert columns(cache) == int(cache.get_seq_length()) == 13
    kv_cache.drop_left(cache, 5)
    assert columns(cache) == int(cache.get_seq_length()) == 8
    kv_cache.select_rows(cache, torch.tensor([2, 0]))
    assert cache.layers[0].recurrent_states[0].shape[0] == cache.layers[1].keys.shape[0] == 2


def test_sliding_layers_grow_and_linear_attention_layers_stay_hugging_faces():
    cfg = Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, use_sliding_window=True,
                      sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    assert kv_cache.has_sliding_window(cfg)
    assert not kv_cache.has_sliding_window(Qwen3Config(num_hidden_layers=2))
    # the window lives in the attention mask: a sliding layer keeps every position, so it can be cut back
    assert [type(x) for x in kv_cache.new_cache(cfg).layers] == [kv_cache.GrowingLayer] * 2
    with kv_cache.kind("dynamic"):
        assert [type(x) for x in kv_cache.new_cache(cfg).layers] == [DynamicLayer] * 2
    assert type(kv_cache.new_cache(cfg).layers[1]) is kv_cache.GrowingLayer      # the default is back
    # per-token state (linear attention) stays Hugging Face's: recorded for a chain's rollback, refused elsewhere
    nxt = Qwen3NextConfig(vocab_size=32, hidden_size=16, num_hidden_layers=4, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=8, linear_num_value_heads=2, linear_num_key_heads=2,
                          linear_key_head_dim=8, linear_value_head_dim=8)
    cache = kv_cache.new_cache(nxt)
    assert LinearAttentionLayer in {type(x) for x in cache.layers}
    with pytest.raises(UserError, match="LinearAttentionLayer layers"):
        kv_cache.check_layers(nxt, "batched decoding")
    kv_cache.check_layers(nxt, "speculative decoding", chain=True)      # it can record its past
    kv_cache.check_layers(cfg, "batched decoding")
    assert kv_cache.record_past(cache, 9) and cache.get_recurrent_states_to_keep() == 9
    assert not kv_cache.record_past(kv_cache.new_cache(cfg), 9)
    with pytest.raises(UserError, match="per-token state"):
        trees.compact_cache(cache, 1, [0, 1])
    with pytest.raises(ValueError, match="growing"):
        with kv_cache.kind("static"):
            pass


def test_window_layouts_and_the_masks_built_for_them():
    from transformers import Gemma3TextConfig, Llama4TextConfig, MistralConfig

    mixed = Gemma3TextConfig(num_hidden_layers=2, sliding_window=3, layer_types=["sliding_attention", "full_attention"])
    assert kv_cache.window_layout(Qwen3Config(num_hidden_layers=2)) is None
    assert kv_cache.window_layout(MistralConfig(num_hidden_layers=2, sliding_window=3)) == "all"
    assert kv_cache.window_layout(mixed) == "mixed"
    assert kv_cache.window_layout(Llama4TextConfig(num_hidden_layers=4)) == "other"          # chunked attention
    mask = torch.zeros(1, 1, 2, 6)
    q_pos, k_pos = torch.tensor([[4, 5]]), torch.arange(6)[None]
    assert kv_cache.layer_masks(Qwen3Config(num_hidden_layers=2), mask, q_pos, k_pos) is mask
    out = kv_cache.layer_masks(mixed, mask, q_pos, k_pos)
    assert out["full_attention"] is mask
    hidden = out["sliding_attention"][0, 0] < 0
    assert hidden.tolist() == [[True, True, False, False, False, False], [True, True, True, False, False, False]]
    with pytest.raises(UserError, match="chunked_attention"):
        kv_cache.layer_masks(Llama4TextConfig(num_hidden_layers=4), mask, q_pos, k_pos)


@pytest.fixture(scope="module")
def shipped():
    from domino_lab.data.eval_sets import load_eval_set
    from domino_lab.models import load_drafter
    from domino_lab.target import Target

    target = Target.from_pretrained("default")
    prompts = [target.encode(p["prompt"]) for s in ("math", "humaneval") for p in load_eval_set(s, limit=2)]
    return target, load_drafter("default", target), prompts


def _decode(target, drafter, prompts):
    from domino_lab import speculative_generate

    out = []
    for p in prompts:
        for nodes in (0, 16):
            res = speculative_generate(target, drafter, prompt_ids=p, max_new_tokens=40, tree_nodes=nodes)
            out.append((res.token_ids, [s.accepted for s in res.steps]))
    res = batched_generate(target, drafter, prompts, max_new_tokens=40, drafts="all")
    return out + [(res.token_ids, res.acceptance_lengths)]


def test_decoding_with_either_cache_is_identical(shipped):
    """The shipped drafter on the embedded target: chains, trees and a batch decode the same tokens in the same
    steps with the growing layer as with Hugging Face's."""
    target, drafter, prompts = shipped
    ours = _decode(target, drafter, prompts)
    with kv_cache.kind("dynamic"):
        ref = _decode(target, drafter, prompts)
    assert ours == ref


def test_kv_cache_experiment_reports_both_kinds(tmp_path):
    """experiments/kv_cache.py decodes every configuration with both layers, checks they agree and writes the
    table and the JSON; bad arguments get one error line and write nothing."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "experiments" / "kv_cache.py"
    spec = importlib.util.spec_from_file_location("kv_cache_experiment", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    args = ["--sets", "math", "--limit", "2", "--engine-limit", "1", "--batch-sizes", "2", "--max-new-tokens", "8",
            "--rounds", "1", "--threads", "1", "--out", str(tmp_path / "r")]
    assert mod.main(args) == 0
    rows = json.loads((tmp_path / "r" / "kv_cache.json").read_text())["rows"]
    assert [(r["decoder"], r["batch"], r["method"]) for r in rows] == [
        ("batched", 2, "ar"), ("batched", 2, "domino"), ("engine", 1, "ar"), ("engine", 1, "domino")]
    assert all(r["identical"] and min(r["tokens_per_s"].values()) > 0 for r in rows)
    assert "| math | batched | 2 | domino |" in (tmp_path / "r" / "kv_cache.md").read_text()
    with pytest.raises(UserError, match="--rounds"):
        mod.main(["--rounds", "0", "--out", str(tmp_path / "bad")])
    assert not (tmp_path / "bad").exists()
