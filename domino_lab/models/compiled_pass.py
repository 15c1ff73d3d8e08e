"""A block drafter's drafting pass (`backbone_impl: compiled`) as compiled graphs that a decode calls without dynamo's
per-call guard evaluation.

torch.compile checks its guards (every input tensor's dtype, sizes and strides, the drafter's attributes, the
relations between symbolic lengths) on every call: about a tenth of a compiled draft step's time on the embedded
target (docs/design.md#compiled-backbone). Here each shape class of a decode's calls gets one graph, compiled ahead
of the first draft (`aot_compile`); a call signature's guards are checked once, at its first call, and after that
the graph runs without them. What a guard could reject that the signature does not pin is the lengths, and those
the shape class pins: torch specialises sizes (and ints) 0 and 1, so an empty cache and a context of one position
take graphs of their own, and every other length is symbolic in the general graph; the cache's buffers have room
for the new positions by construction (the drafter reserves it before the call). Inductor's own size and stride
asserts stay in the compiled code, so an input laid out otherwise fails loudly rather than being read wrong. A call
in a class without a graph, or one whose first guard check fails, goes through ordinary torch.compile (guards every
call).
"""
from __future__ import annotations

import torch

# (cached positions, new context positions) of the warm-up calls, one per shape class: an empty cache, the general
# case and a context of one position
WARM_SHAPES = ((0, 3), (13, 3), (13, 1))
# On a CPU, inductor writes the code that runs a graph's kernels (allocating its buffers, asserting its inputs'
# sizes, calling ~60 kernels and 25 matmuls) in C++ instead of Python: 1-9% of a compiled draft step on the
# embedded target, for a few seconds more at the first compile (docs/design.md#compiled-backbone). GPUs keep the
# Python wrapper, which this project has not measured against the C++ one there.
CPP_WRAPPER = True


def shape_class(ctx_feats: torch.Tensor, n_past: int) -> tuple[int, int]:
    """(cached positions, new context positions), each as 0, 1 or 2 = "two or more"."""
    return min(n_past, 2), min(ctx_feats.shape[1], 2)


class CompiledPass:
    """`fn` (a drafter method, unbound, taking (self, anchor, copy, ctx_feats, pos, kv, n_past, *rows)) compiled for
    the shape classes of `examples` (argument tuples after `self`, one per class) before any call;
    `__call__(owner, *args)` as `fn(owner, *args)`. The graphs read the drafter's weights from `owner`, so every
    drafter of one structure can share them (`shared`)."""

    def __init__(self, fn, owner, examples):
        self.fn = fn
        self.graphs = {}
        # (the drafter's float attributes, its norms' epsilons, as constants: ahead-of-time compiling cannot redo the
        # analysis that torch.compile redoes when it meets them as symbolic floats)
        cpp = CPP_WRAPPER and examples[0][2].device.type == "cpu"
        with torch._dynamo.config.patch(specialize_float=True), torch._inductor.config.patch(cpp_wrapper=cpp):
            for args in examples:
                graph = torch.compile(fn, dynamic=True, fullgraph=True).aot_compile(((owner, *args), {}))
                self.graphs[shape_class(args[2], args[5])] = graph
        self.checked: dict[tuple, bool] = {}   # call signature -> whether its graph's guards held at its first call
        self._dynamo = None

    @staticmethod
    def _signature(owner, args, cls) -> tuple:
        """What a call's guards test that its shape class does not: the drafter, grad mode, the inputs' kinds,
        dtypes, ranks and devices. (The one int argument, the cached length, is symbolic in its graph from 2 on:
        its class pins it.)"""
        return id(owner), cls, torch.is_grad_enabled(), tuple(
            (a.dtype, a.dim(), a.device) if isinstance(a, torch.Tensor) else min(a, 2) if isinstance(a, int)
            else type(a) for a in args if not isinstance(a, (list, tuple))), tuple(type(a) for a in args[1] or ())

    def __call__(self, owner, *args):
        cls = shape_class(args[2], args[5])
        graph = self.graphs.get(cls)
        if graph is not None:
            sig = self._signature(owner, args, cls)
            ok = self.checked.get(sig)
            if ok is None:
                ok = self.checked[sig] = graph.guard_check(owner, *args)
                graph.disable_guard_check()        # (a signature that failed never calls this graph)
            if ok:
                return graph(owner, *args)
        if self._dynamo is None:
            self._dynamo = torch.compile(self.fn, dynamic=True)
        return self._dynamo(owner, *args)


_shared: dict[tuple, CompiledPass] = {}


def shared(fn, owner, key: str, examples) -> CompiledPass:
    """The CompiledPass of `fn` for drafters whose structure `key` names (their config), compiled at the first call
    in the process: a bench or a test suite with several drafters of one structure compiles their graphs once."""
    k = (fn.__qualname__, type(owner).__qualname__, key)
    if k not in _shared:
        _shared[k] = CompiledPass(fn, owner, examples)
    return _shared[k]


def clear() -> None:
    """Forget every shared pass (the next drafter compiles its graphs again)."""
    _shared.clear()
