"""The decoders' K/V caches: Hugging Face's `DynamicCache`, with its plain full-attention layers writing into a
preallocated buffer instead of concatenating.

A `DynamicLayer` appends a step's keys and values with `torch.cat`, which copies the whole cache every forward. At
batch 1 on the embedded target that copy is a few hundred kilobytes and costs nothing measurable; at batch 16 it is
megabytes per step, ~15% of a batched decode's time. `GrowingLayer` keeps each layer's keys and values in a buffer
and hands attention a view of its filled prefix, so a step copies only its own new positions. The buffer is
allocated once at the size a decode can reach when the caller knows it (`capacity`: the batch-1 engine) and grows
geometrically past it or without it (docs/design.md#kv-cache has the measurements).

Everything the decoders do to a cache keeps working unchanged, because the layer never trusts that its `keys` are
still its buffer: `crop` (inherited) narrows the view, tree compaction writes into the view in place, and
`batch_select_indices` (inherited) replaces it with a new tensor; `update` writes in place only while `keys` is a
prefix view of the buffer with room left, and otherwise copies the current contents into a fresh buffer first.
A sliding-window layer (Mistral-style windows, Gemma's alternating local layers) is replaced too: Hugging Face's
keeps only its last positions and refuses to be cropped past them, and speculative decoding crops every step. A
batch-1 chain gets a `WindowLayer`, which keeps the window plus the latest forward's tokens, so any of them can be
cut back, and tells Hugging Face's mask where its columns start; a tree's own mask leaves out the columns it
dropped (`layer_masks`). A batch's rows keep rejected drafts as holes, so their columns run ahead of their
positions: batches get a `RowsWindowLayer`, which drops the leading columns no row's window reaches any more (read
from the rows' positions), and their own masks hide the keys outside the window, counted in token positions
(docs/design.md#sliding-window-targets). Other special layers (linear
attention and other per-token state) stay as Hugging Face builds them: decoding has them record their recent states
(`record_past`) so that rejected drafts can be undone, for every row alike in a batch-1 chain (their `crop`) or per
row in a batch (`cut_back_rows`), and `check_layers` refuses them where a decoder would need more (trees).

Batched decoding with a queue of prompts (decoding/batched.py) also writes a new sequence into a finished row of a
running batch (`place_rows`: in place, right-aligned, the row's older positions hidden by the attention mask), stacks
the caches of prompts prefilled in groups (`stack_rows`, right-aligned, only those new rows copied), and rarely copies
the batch: `widen` (zeros in front, for a prompt longer than the batch's positions), `trim_left` (leading
positions no live row attends to any more), `drop_outside_windows` and a window layer's `hold` hand the layer new
tensors, which its next `update` copies into a fresh buffer, as after `batch_select_indices`. (Widening copies
nothing in window layers, whose offset moves, or in linear-attention layers, which only count columns.)
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
from transformers import DynamicCache
from transformers.cache_utils import (DummyLayer, DynamicLayer, DynamicSlidingWindowLayer,
                                      LinearAttentionAndFullAttentionLayer, LinearAttentionLayer)

from ..errors import UserError

KINDS = ("growing", "dynamic")
# linear-attention layers that batches cut back per row (`cut_back_rows`): states only, or states and K/V in one
STATE_LAYERS = (LinearAttentionLayer, LinearAttentionAndFullAttentionLayer)
_kind = "growing"
MIN_ROOM = 64          # spare positions at least, so a batch-1 decode reallocates every 64 tokens at most


class GrowingLayer(DynamicLayer):
    """A full-attention cache layer whose keys / values are views of a buffer with spare positions. `capacity`:
    the positions a decode expects to need (the prompt, the new tokens, one verify's drafts), so that its buffer is
    allocated once at that size; beyond it, or without it, the buffer grows geometrically."""

    _k: torch.Tensor | None = None
    _v: torch.Tensor | None = None
    _views: tuple | None = None         # the (keys, values) the last update returned, while nothing replaced them

    def __init__(self, capacity: int | None = None):
        super().__init__()
        self.capacity = capacity

    def _in_place(self, new: int) -> bool:
        """Whether `keys` / `values` are still the filled prefix of the buffers, with room for `new` positions."""
        k, v, bk, bv = self.keys, self.values, self._k, self._v
        if bk is None or k.shape[-2] + new > bk.shape[-2]:
            return False
        if self._views is not None and k is self._views[0] and v is self._views[1]:
            return True                 # the common case, one identity test: the views of the last update
        return (k.numel() > 0 and k.data_ptr() == bk.data_ptr() and v.data_ptr() == bv.data_ptr()
                and k.shape[:-2] == bk.shape[:-2] and k.stride() == bk.stride() and v.stride() == bv.stride())

    def _reallocate(self, keys: torch.Tensor, values: torch.Tensor, new: int) -> None:
        """Fresh buffers holding `keys` / `values` (the current contents, possibly empty) with room for `new` more."""
        n = keys.shape[-2]
        need = n + new
        # the expected size when it is known and enough; else 1.5x (never more than ~1.5x the positions in use)
        size = self.capacity if self.capacity and need <= self.capacity else need + max(MIN_ROOM, need // 2)
        self._k = keys.new_empty(*keys.shape[:-2], size, keys.shape[-1])
        self._v = values.new_empty(*values.shape[:-2], size, values.shape[-1])
        self._k.narrow(-2, 0, n).copy_(keys)
        self._v.narrow(-2, 0, n).copy_(values)
        self._filled(n)

    def _filled(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Make the buffers' first n positions the layer's keys and values."""
        self.keys, self.values = self._views = (self._k.narrow(-2, 0, n), self._v.narrow(-2, 0, n))
        return self._views

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        new = key_states.shape[-2]
        k, v, n = self.reserve(key_states, value_states, new)
        k.narrow(-2, n, new).copy_(key_states)
        v.narrow(-2, n, new).copy_(value_states)
        return self.extend(new)

    def reserve(self, key_like: torch.Tensor, value_like: torch.Tensor, new: int
                ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The key and value buffers with room for `new` positions after the `n` filled ones, and n. A caller that
        writes the new positions into `buffer[..., n:n + new, :]` itself (the compiled drafting pass does, inside its
        graph) then calls `extend(new)`. `key_like` / `value_like` give an empty layer its layout and dtype."""
        if not self.is_initialized:
            self.lazy_initialization(key_like, value_like)
        if not self._in_place(new):
            empty = self.keys.numel() == 0
            self._reallocate(key_like.narrow(-2, 0, 0) if empty else self.keys,
                             value_like.narrow(-2, 0, 0) if empty else self.values, new)
        return self._k, self._v, self.keys.shape[-2]

    def extend(self, new: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Count `new` more positions of the buffers as filled (after `reserve` and the caller's write)."""
        return self._filled(self.keys.shape[-2] + new)

    def reset(self) -> None:
        self._k = self._v = self._views = None
        super().reset()


class WindowLayer(DynamicLayer):
    """A sliding-window layer that batch-1 decoding (chain or tree) can cut back: it keeps the W − 1 positions before
    the latest forward's tokens, so a crop of up to that forward's tokens leaves every position the next forward's
    queries see within the window. Its memory is bounded by the window, not the context (a full layer's grows with
    the context). The kept positions are a view of a buffer of two to four times W − 1 + `room` positions; the front
    of the buffer fills with dropped positions, and the kept ones move back to its start once it is full (a copy of
    W − 1 positions every W or more tokens). Hugging Face's mask for the sliding layers learns where the kept columns
    start from `get_mask_sizes` (`offset`: the positions before the first kept one)."""

    is_sliding = True

    def __init__(self, window: int, room: int = MIN_ROOM):
        super().__init__()
        self.window, self.room = window, room
        self.offset = 0                     # positions dropped from the front
        self._k = self._v = self._views = None
        self._start = self._len = 0         # the kept positions: buffer[_start : _start + _len]

    def _set_views(self) -> None:
        self.keys, self.values = self._views = (self._k.narrow(-2, self._start, self._len),
                                                self._v.narrow(-2, self._start, self._len))

    def _stale(self) -> bool:
        """Whether `keys` / `values` are no longer the views this layer set (first use, or replaced from outside)."""
        return self._views is None or self.keys is not self._views[0] or self.values is not self._views[1]

    def _make_room(self, key_states: torch.Tensor, value_states: torch.Tensor, new: int) -> None:
        """Room for `new` positions after the kept ones: the kept ones moved to the front of the buffer, or into a
        fresh one when it is too small or far larger than a window needs (after a long prompt). `key_states` /
        `value_states`: this forward's, whose shapes a first buffer takes."""
        if self._stale():
            # first use, or replaced from outside: start over from what `keys` / `values` hold
            empty = self.keys.numel() == 0
            keys = key_states.narrow(-2, 0, 0) if empty else self.keys
            values = value_states.narrow(-2, 0, 0) if empty else self.values
            self._len = keys.shape[-2]
        else:
            keys = self._k.narrow(-2, self._start, self._len)
            values = self._v.narrow(-2, self._start, self._len)
        size = max(2 * (self.window - 1 + self.room), self._len + new + self.room)
        if self._k is None or self._k.shape[-2] < size or self._k.shape[-2] > 2 * size:
            self._k = keys.new_empty(*keys.shape[:-2], size, keys.shape[-1])
            self._v = values.new_empty(*values.shape[:-2], size, values.shape[-1])
        keys, values = keys.clone(), values.clone()       # (the kept positions may overlap their destination)
        self._k.narrow(-2, 0, self._len).copy_(keys)
        self._v.narrow(-2, 0, self._len).copy_(values)
        self._start = 0
        self._set_views()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        if self._stale() or self._start + self._len + new > self._k.shape[-2]:
            self._make_room(key_states, value_states, new)
        at = self._start + self._len
        self._k.narrow(-2, at, new).copy_(key_states)
        self._v.narrow(-2, at, new).copy_(value_states)
        self._len += new
        every = (self._k.narrow(-2, self._start, self._len), self._v.narrow(-2, self._start, self._len))
        # the next forward sees at most W − 1 positions back, and a crop removes at most this forward's tokens
        drop = max(0, self._len - new - (self.window - 1))
        self._start, self._len, self.offset = self._start + drop, self._len - drop, self.offset + drop
        self._set_views()
        if drop and self._k.shape[-2] > 4 * (self.window - 1 + self.room):
            self._make_room(key_states, value_states, 0)      # a long prompt's buffer: down to a window's size
        return every                        # what this forward's mask was built for (get_mask_sizes, before)

    def get_seq_length(self) -> int:
        return self.offset + (self.keys.shape[-2] if self.is_initialized else 0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return (self.keys.shape[-2] if self.is_initialized else 0) + query_length, self.offset

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative number, the positions to remove")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        kept = self.keys.shape[-2] + tokens_to_remove
        if kept < 0 or (self.offset and kept < self.window - 1):
            raise RuntimeError(f"a sliding-window cache keeping {self.keys.shape[-2]} positions cannot remove "
                               f"{-tokens_to_remove}: the next forward's window would reach dropped positions")
        super().crop(tokens_to_remove)
        if self._views is not None and self.keys.data_ptr() == self._views[0].data_ptr():
            self._len = kept
            self._set_views()

    def reset(self) -> None:
        self._k = self._v = self._views = None
        self._start = self._len = self.offset = 0
        super().reset()


class RowsWindowLayer(GrowingLayer):
    """A batch's sliding-window layer: a growing layer over the batch's last columns, `offset` of the leading ones
    dropped. Rows keep rejected drafts as holes and join at any time, so what is dropped is decided from every row's
    positions (`drop_outside_windows`: the columns no live row's window reaches any more), not from a count of
    positions as in `WindowLayer`. A row that joins needs its last W − 1 prompt positions here (`put_rows` pads the
    front with zeros when fewer columns are held; other rows' windows never reach those columns). Verifies pass their
    own masks, the sliding layers' cut at `offset` (`layer_masks`); only a prefill, at offset 0, has Hugging Face
    build one from `get_mask_sizes`."""

    def __init__(self, window: int, capacity: int | None = None):
        super().__init__(capacity)
        self.window = window
        self.offset = 0                     # leading batch columns no longer held

    def held(self) -> int:
        return self.keys.shape[-2] if self.is_initialized else 0

    def hold(self, n: int) -> None:
        """Hold at least n columns (no more than the batch has), zeros in front for those dropped earlier."""
        short = min(n, self.offset + self.held()) - self.held()
        if short > 0:
            self.keys, self.values = _pad_left(self.keys, short), _pad_left(self.values, short)
            self.offset -= short

    def get_seq_length(self) -> int:
        return self.offset + self.held()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.held() + query_length, self.offset

    def reset(self) -> None:
        self.offset = 0
        super().reset()


def new_cache(config=None, capacity: int | None = None, bounded_windows: bool = False,
              batch_windows: bool = False) -> DynamicCache:
    """A cache for a decode: the model's layers from its config (None: plain layers added as they are used, as
    `DynamicCache()` does), the plain ones growing in place unless `kind("dynamic")` is in effect; `capacity`, the
    positions the decode expects to hold (a hint: a buffer allocated at that size, grown past it if needed).
    Sliding-window layers become full layers, whose window is in the attention mask (module docstring), or with
    `bounded_windows` (batch-1 decoding, which only cuts back its last forward's tokens) `WindowLayer`s, or with
    `batch_windows` (batched decoding, which drops what no row's window reaches: `drop_outside_windows`)
    `RowsWindowLayer`s."""
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    plain = partial(GrowingLayer, capacity) if _kind == "growing" else DynamicLayer

    def sliding(layer):
        if bounded_windows:
            return WindowLayer(layer.sliding_window)
        return RowsWindowLayer(layer.sliding_window, capacity) if batch_windows else plain()

    if config is None:
        if _kind == "growing":
            cache.layer_class_to_replicate = plain
    else:
        cache.layers = [sliding(layer) if type(layer) is DynamicSlidingWindowLayer else
                        plain() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def has_sliding_window(config) -> bool:
    """Whether Hugging Face gives this model sliding-window layers (its own reading of the config: `sliding_window`,
    `use_sliding_window`, `layer_types`; chunked attention counts too)."""
    if getattr(config, "sliding_window", None) is None and \
            set(getattr(config, "layer_types", None) or ()) <= {"full_attention"}:
        return False                    # the common case, without building a cache (a tree step asks every time)
    return any(DynamicCache(config=config).is_sliding)


def _recordable(layer) -> bool:
    """A layer holding per-token state (linear attention) whose past Hugging Face can record for a rollback."""
    return hasattr(layer, "activate_past_recording")


def window_layout(config) -> str | None:
    """Where the target's sliding windows are, for a caller that builds the attention mask itself: None (nowhere),
    "all" (every layer: one mask serves), "mixed" (`layer_types` of full and sliding layers: a mask per type) or
    "other" (layer types such a mask does not describe, e.g. chunked attention)."""
    if not has_sliding_window(config):
        return None
    types = set(getattr(config, "layer_types", None) or ())
    if not types:
        return "all"
    return "mixed" if types <= {"full_attention", "sliding_attention"} else "other"


def layer_masks(config, mask: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, dropped: int = 0):
    """What to pass a target's forward as its attention mask, given `mask` (additive, [b, 1, q, k]: causality, holes,
    a tree's ancestry) and the token positions of its queries [b, q] and keys [b, k]: `mask` itself without sliding
    windows; with them, the same mask also hiding keys a window or more behind the query, for every layer ("all")
    or, as a dict by layer type that such models take in place of building their own masks, for the sliding ones.
    `dropped`: the leading key columns the sliding layers no longer hold (`WindowLayer.offset` or
    `RowsWindowLayer.offset`), cut from their mask."""
    layout = window_layout(config)
    if layout is None:
        return mask
    if layout == "other":
        check_layers(config, "an attention mask built by domino-lab")          # (raises: callers check up front)
    far = (q_pos[:, :, None] - k_pos[:, None, :] >= config.sliding_window)[:, None]
    windowed = mask.masked_fill(far, torch.finfo(mask.dtype).min)[..., dropped:]
    return windowed if layout == "all" else {"full_attention": mask, "sliding_attention": windowed}


def window_offset(cache: DynamicCache) -> int:
    """How many leading positions the cache's window layers have dropped (the same for each), 0 without any."""
    return next((layer.offset for layer in cache.layers if type(layer) in (WindowLayer, RowsWindowLayer)), 0)


def check_layers(config, what: str, chain: bool = False, cache: DynamicCache | None = None,
                 rows: bool = False) -> None:
    """Whether a decoder can run on this target's layers, or one clear error before any decoding. Speculative and
    batched decoding cut the cache back and move its rows, which the layers a `new_cache` leaves as Hugging Face
    builds them (linear attention and other per-token state) do not allow; trees and batches build their own
    attention masks, which describe full and sliding-window layers only (`layer_masks`). `chain`: a batch-1 chain,
    which uses Hugging Face's masks and only undoes the last verify's rejected tokens; layers that can record their
    recent states for that (`record_past`) are accepted there. `rows`: batched decoding, which undoes each row's
    rejected tokens in linear-attention layers of their own (`cut_back_rows`). Layers without a cache (MLP-only
    ones) are accepted everywhere. `cache`: the decode's `new_cache`, when it has one."""
    special = [layer for layer in (cache if cache is not None else new_cache(config)).layers
               if type(layer) not in (DynamicLayer, GrowingLayer, WindowLayer, DummyLayer)]
    refused = sorted({type(layer).__name__ for layer in special
                      if not (chain and _recordable(layer)) and not (rows and type(layer) in STATE_LAYERS)})
    one_at_a_time = "decode it one sequence at a time with chain verification (tree nodes 0)"
    if refused:
        fix = f"{one_at_a_time}, or without a drafter" if all(map(_recordable, special)) and not chain else \
            "decode it without a drafter"
        raise UserError(f"{what} needs a target whose K/V cache can be cut back to any position; this one has "
                        f"{', '.join(refused)} layers (a recurrent state, as linear attention and Mamba keep): {fix}")
    if not chain and window_layout(config) == "other":
        raise UserError(f"{what} supports full and sliding-window attention layers; this target has "
                        f"{sorted(set(config.layer_types))}: {one_at_a_time}")


def attends(config) -> bool:
    """Whether the target has any attention (K/V) layer; a model of linear-attention or Mamba layers only has none,
    and its forwards then need no attention mask after the prefill."""
    return any(type(layer) not in (LinearAttentionLayer, DummyLayer) for layer in new_cache(config).layers)


def check_positions(target, what: str, fix: str) -> None:
    """Whether the target attends by the positions a decoder gives its tokens, or one clear error before any decoding.
    Trees and batches give tokens positions other than their columns in the cache (a tree's nodes sit side by side, a
    batch's rows keep the holes of rejected drafts), which a target that reads positions from the columns
    (`Target.ignores_positions`: ALiBi) would silently attend to wrongly, or fail on inside the model. A target
    without attention has no positions to misread, and one with a cache class of its own (xLSTM) is refused at its
    first forward whatever the mode (Target._own_cache_error). `fix`: what to do instead."""
    if target.ignores_positions and target.own_cache is None and attends(target.model.config):
        name = getattr(target.model.config, "model_type", type(target.model).__name__)
        raise UserError(f"{what} gives tokens positions other than their order in the cache, and this target "
                        f"({name}) takes its attention's positions from that order (as ALiBi does): {fix}")


def check_recording(target, what: str) -> None:
    """Whether the target's linear-attention layers keep their state after each token of a forward when asked to
    (`record_past`), which undoing rejected drafts relies on, or one clear error before any decoding. Most Hugging
    Face models do; some (Zamba) update the state in place in a one-token forward and keep one state at most in a
    longer one. Probed with three tokens: a forward of 2 and then of 1, each of which must leave that many states."""
    if getattr(target, "records_states", False):
        return                          # (probed before)
    cache = new_cache(target.model.config)
    if not any(_recordable(layer) for layer in cache.layers):
        return
    dev = target.device

    def forward(n: int, start: int):
        target.forward(torch.zeros(1, n, dtype=torch.long, device=dev), cache=cache, last_logits_only=True,
                       position_ids=torch.arange(start, start + n, device=dev)[None])

    def refuse() -> UserError:
        name = getattr(target.model.config, "model_type", type(target.model).__name__)
        return UserError(f"{what} needs a target whose linear-attention layers can keep their state after each "
                         f"token of a forward, to undo rejected drafts; this one ({name}) does not: decode it "
                         "without a drafter, one sequence at a time")

    forward(1, 0)
    # a layer the forward left without a conv state cannot be cut back (Hugging Face's crop reads its kernel size):
    # RecurrentGemma keeps its states in its own modules, out of the cache's reach
    if any(None in layer.conv_kernel_size.values() for layer in cache.layers if _recordable(layer)):
        raise refuse()
    record_past(cache, 2)
    for n, start in ((2, 1), (1, 3)):
        forward(n, start)
        kept = {len(layer.recurrent_states_history[i]) for layer in cache.layers if _recordable(layer)
                for i in range(layer.number_of_states) if layer.is_recurrent_states_initialized[i]}
        if kept and kept != {n}:
            raise refuse()
        cache.crop(0)                   # (drops what was recorded)
    target.records_states = True


def record_past(cache: DynamicCache, tokens: int) -> bool:
    """Have the layers that hold per-token state keep their states after each of a forward's last `tokens` tokens,
    so that `crop` can restore the state before a rejected draft (Hugging Face's own rollback for assisted decoding;
    called after the prefill, whose states nobody needs). Returns whether any layer records; those layers then need
    a `crop` after every forward, `crop(0)` included, which drops the recorded states."""
    if not any(_recordable(layer) for layer in cache.layers):
        return False
    cache.activate_past_recording(recurrent_states_to_keep=tokens)
    return True


def _plain_layers(cache: DynamicCache) -> list:
    """The cache's initialized K/V layers, which must line up with the batch's columns: full-attention ones, and batch
    window layers, which know how many leading columns they dropped (Hugging Face's sliding windows and `WindowLayer`
    keep a count of positions, which a batch's holes move away from its columns)."""
    layers = [layer for layer in cache.layers if getattr(layer, "is_initialized", False)
              and getattr(layer, "keys", None) is not None and layer.keys.numel() > 0]
    if any(layer.is_sliding for layer in layers):
        raise ValueError("joining or trimming batch rows needs full-attention cache layers, not sliding windows")
    return layers


def _state_layers(cache: DynamicCache) -> list:
    """The cache's linear-attention layers (a conv state and a recurrent state per row; the hybrid kind holds K/V as
    well, which the K/V functions treat as any). They count the batch's columns too (`cumulative_length_linear`, which
    the model reads as the cache's length when the first layer is one of them), so whatever adds or removes columns
    adjusts that count."""
    return [layer for layer in cache.layers if type(layer) in STATE_LAYERS]


def _columns(cache: DynamicCache) -> int:
    """How many columns a batch cache has (its K/V layers' length, or what its linear-attention layers count)."""
    plain = _plain_layers(cache)
    return plain[0].get_seq_length() if plain else int(_state_layers(cache)[0].cumulative_length_linear)


def _states(layer) -> list[tuple[dict, int]]:
    """(the layer's dict of conv or recurrent states, state index) for each state it holds."""
    return [(d, i) for i in range(layer.number_of_states)
            for d, ok in ((layer.conv_states, layer.is_conv_states_initialized[i]),
                          (layer.recurrent_states, layer.is_recurrent_states_initialized[i])) if ok]


def _pad_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [b, h, T, d] with n zero positions in front (masked holes: nothing attends to them)."""
    return x if n == 0 else torch.cat([x.new_zeros(*x.shape[:-2], n, x.shape[-1]), x], dim=-2)


def put_rows(cache: DynamicCache, other: DynamicCache, rows: torch.Tensor) -> None:
    """Write `other`'s rows into rows `rows` of `cache`, in place and right-aligned (batched decoding handing a
    finished row's place to a new sequence); `cache` must be at least as long. The row's positions before them keep
    their old contents, which the caller's attention mask hides."""
    for a, b in zip(_plain_layers(cache), _plain_layers(other), strict=True):
        if type(a) is RowsWindowLayer:
            a.hold(min(b.keys.shape[-2], a.window - 1))
        for name in ("keys", "values"):
            x, y = getattr(a, name), getattr(b, name)
            # (only a window layer holds fewer columns: the row's earlier ones are outside its window)
            n = min(x.shape[-2], y.shape[-2])
            x[rows, :, x.shape[-2] - n:] = y[..., y.shape[-2] - n:, :]
    for a, b in zip(_state_layers(cache), _state_layers(other), strict=True):
        for (x, i), (y, _) in zip(_states(a), _states(b), strict=True):
            x[i][rows] = y[i]


def stack_rows(caches: list[DynamicCache]) -> DynamicCache:
    """The rows of several caches as one (the first, refilled), right-aligned at the longest, zeros in front that the
    caller's attention mask hides."""
    layers = [_plain_layers(c) for c in caches]
    if any(getattr(layer, "offset", 0) for ls in layers for layer in ls):
        raise ValueError("stack_rows takes freshly prefilled caches, whose window layers hold every column")
    n = max(map(_columns, caches))
    for i, layer in enumerate(layers[0]):
        for name in ("keys", "values"):
            setattr(layer, name, torch.cat([_pad_left(getattr(ls[i], name), n - getattr(ls[i], name).shape[-2])
                                            for ls in layers]))
    states = [_state_layers(c) for c in caches]
    for i, layer in enumerate(states[0]):
        for (d, j), *others in zip(*[_states(ls[i]) for ls in states]):
            d[j] = torch.cat([d[j]] + [o[j] for o, _ in others])
        layer.cumulative_length_linear.fill_(n)
    return caches[0]


def widen(cache: DynamicCache, n: int) -> None:
    """Put n zero positions in front of every row (room for a longer sequence to be right-aligned; a copy of the
    K/V layers; a window layer's offset moves instead, and linear-attention layers count n more columns)."""
    for layer in _plain_layers(cache):
        if type(layer) is RowsWindowLayer:
            layer.offset += n                   # (columns it does not hold; `put_rows` holds what a row needs)
        else:
            layer.keys, layer.values = _pad_left(layer.keys, n), _pad_left(layer.values, n)
    for layer in _state_layers(cache):
        layer.cumulative_length_linear.add_(n)


def drop_left(cache: DynamicCache, n: int) -> None:
    """Remove the first n positions of every row (columns that no live row attends to any more)."""
    if n > 0:
        for layer in _plain_layers(cache):
            cut = n
            if type(layer) is RowsWindowLayer:
                cut, layer.offset = max(0, n - layer.offset), max(0, layer.offset - n)
            if cut:
                layer.keys, layer.values = layer.keys[..., cut:, :], layer.values[..., cut:, :]
        for layer in _state_layers(cache):
            layer.cumulative_length_linear.sub_(n)


def select_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Keep only these rows of every layer (`DynamicCache.batch_select_indices`, which linear-attention layers lack:
    their states are selected as for beam search)."""
    for layer in cache.layers:
        if type(layer) in STATE_LAYERS:
            layer.reorder_cache(rows)       # (the hybrid kind's selects its K/V too)
        else:
            layer.batch_select_indices(rows)


def cut_back_rows(cache: DynamicCache, tokens: int, remove: torch.Tensor, cut: int) -> None:
    """After a batch's verify of `tokens` tokens, in which row r rejected its last `remove[r]`: K/V layers keep rejected
    tokens as holes (the caller's mask hides them) and lose only the last `cut` columns, those every row rejected.
    Linear-attention layers, which must not have taken the rejected tokens in, go back per row to the states they
    recorded (`record_past`): the conv state's last kernel width before those tokens, the recurrent state after the
    row's accepted ones. Then, as their own `crop` does for every row alike, the record is dropped and the conv
    states are a kernel wide again."""
    for layer in cache.layers:
        if type(layer) is LinearAttentionAndFullAttentionLayer and cut:
            DynamicLayer.crop(layer, -cut)  # its K/V (its own crop would also cut every row's states alike)
        if type(layer) not in STATE_LAYERS:
            if cut:
                layer.crop(-cut)
            continue
        if not layer.record_past:
            raise RuntimeError("a batch's linear-attention layers must record their states (record_past) to be cut "
                               "back")
        layer.cumulative_length_linear.sub_(cut)
        batch = torch.arange(remove.shape[0], device=remove.device)
        for i in range(layer.number_of_states):
            if layer.is_conv_states_initialized[i]:
                conv, width = layer.conv_states[i], layer.conv_kernel_size[i]     # [rows, C, width + k]
                at = (conv.shape[-1] - width - remove)[:, None, None] + torch.arange(width, device=conv.device)
                layer.conv_states[i] = conv.gather(-1, at.expand(-1, conv.shape[1], -1))
            if layer.is_recurrent_states_initialized[i]:
                # the states after 0, 1, ... k - 1 of the verify's tokens, then after all k
                history = layer.recurrent_states_history[i]
                if len(history) != tokens:
                    raise RuntimeError(f"a linear-attention layer recorded {len(history)} states in a verify of "
                                       f"{tokens} tokens (record_past for at least as many)")
                layer.recurrent_states[i] = torch.stack(list(history) + [layer.recurrent_states[i]])[tokens - remove,
                                                                                                     batch]
                layer.recurrent_states_history[i] = []


def drop_outside_windows(cache: DynamicCache, valid: torch.Tensor, next_pos: torch.Tensor,
                         least: int | None = None) -> None:
    """Drop the leading columns of a batch's window layers that no row's window reaches any more, once at least
    `least` of them have passed (default: a quarter window, at least MIN_ROOM or the window; each drop copies the
    window on the next forward, so not every step). `valid` [rows, columns]: the
    batch's real positions (a row's positions count its valid columns); `next_pos` [rows]: each row's next query
    position. A key is seen while the query is less than a window past it, so a row needs the columns holding its
    positions from next_pos − W + 1 on."""
    layers = [layer for layer in cache.layers if type(layer) is RowsWindowLayer and layer.is_initialized]
    if not layers:
        return
    window = layers[0].window               # (one per model: the config's, as in `layer_masks`)
    pos = valid.long().cumsum(-1) - 1
    needed = (valid & (pos > next_pos[:, None] - window)).any(0)
    lead = int(needed.long().argmax()) if needed.any() else valid.shape[1]
    if lead - layers[0].offset >= (least if least is not None else max(window // 4, min(window, MIN_ROOM))):
        for layer in layers:
            cut = lead - layer.offset
            layer.keys, layer.values = layer.keys[..., cut:, :], layer.values[..., cut:, :]
            layer.offset = lead


def place_rows(cache: DynamicCache, valid: torch.Tensor, other: DynamicCache, other_valid: torch.Tensor,
               rows: torch.Tensor) -> torch.Tensor:
    """`other`'s sequences (their validity [n, w], True = a real position) written into rows `rows` of `cache`,
    right-aligned, the caches widened first if they are longer; returns the batch's validity with those rows
    replaced (their earlier positions masked)."""
    extra = other_valid.shape[1] - valid.shape[1]
    if extra > 0:
        widen(cache, extra)
        valid = torch.nn.functional.pad(valid, (extra, 0))
    put_rows(cache, other, rows)
    valid[rows] = torch.nn.functional.pad(other_valid, (valid.shape[1] - other_valid.shape[1], 0))
    return valid


def trim_left(cache: DynamicCache, valid: torch.Tensor, least: int) -> torch.Tensor:
    """Drop the leading positions no row attends to (validity [rows, positions]) when there are at least `least` of
    them (each trim copies the cache); returns the validity that is left."""
    lead = int(valid.any(0).long().argmax()) if valid.any() else valid.shape[1]
    if lead < least:
        return valid
    drop_left(cache, lead)
    return valid[:, lead:]


@contextmanager
def kind(name: str):
    """Decode with another cache layer inside the block ("growing", the default, or "dynamic": Hugging Face's
    concatenating layer), e.g. to measure one against the other."""
    global _kind
    if name not in KINDS:
        raise ValueError(f"unknown K/V cache kind {name!r}; use one of {list(KINDS)}")
    old, _kind = _kind, name
    try:
        yield
    finally:
        _kind = old
