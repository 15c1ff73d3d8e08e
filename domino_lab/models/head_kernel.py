"""head_impl = "fused": the Domino head's rollout as one C++ loop on the CPU (head_kernel.cpp), greedy or sampled,
one level of tree drafting (every branch's GRU step and its children's ranking) as another, and a whole best-first
tree (every level and the selection between them) as a third.

Why a hand-written loop: on 2 CPU cores the rollout is ~30 tiny tensor ops per slot, and their dispatch costs far
more than their arithmetic. Measured on the embedded default inside decoding (block 8, K = 64): the torch-op fast
path adds 2.3–2.5 ms per draft step, `torch.compile` (C++ wrapper) 1.9–2.6 ms, about 1 ms of it dynamo guards and
call overhead; this loop adds ~0.5 ms, of which ~0.35 ms is streaming the 852 KB [W1_S ; W_hh]^T once per slot
(experiments/results/bench.md, "The head's cost in decoding").

Built on first use with the system C++ compiler ($CXX, else c++ / g++ / clang++) into
$DOMINO_LAB_CACHE/kernels (default ~/.cache/domino_lab/kernels), keyed by the source, compiler, flags and CPU,
written to a temporary name and renamed into place; loaded with ctypes. No torch headers, so a build takes about
a second (torch.utils.cpp_extension needs a minute). Where the loop cannot run (no compiler: warned once; a CUDA
tensor; a dtype other than float32/float64) `prepare` / `fused_greedy_rollout` return None and the caller uses
the torch path, whose drafts the loop matches (`domino_head.Branches` checks the same before using
`fused_branch_level`).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("head_kernel.cpp")
# -march=native: the .so is cached per CPU (see _cpu_id); the plain -O3 build is the fallback for compilers
# that reject a flag. -fopenmp-simd only honours the `omp simd` pragmas (no threads); -fno-trapping-math lets the
# gate loops (with their clamped exp) vectorise: we never read floating-point exception flags.
FLAG_SETS = (["-O3", "-march=native", "-fopenmp-simd", "-fno-trapping-math"], ["-O3"])
COMMON = ["-std=c++17", "-shared", "-fPIC"]
_FUNCS = {torch.float32: "domino_rollout_f32", torch.float64: "domino_rollout_f64"}
_BRANCH_FUNCS = {torch.float32: "domino_branches_f32", torch.float64: "domino_branches_f64"}
_SAMPLED_FUNCS = {torch.float32: "domino_sampled_f32", torch.float64: "domino_sampled_f64"}
_TREE_FUNCS = {torch.float32: "domino_tree_f32", torch.float64: "domino_tree_f64"}
_lib: ctypes.CDLL | None | bool = None       # None: not tried yet; False: unavailable (warned once)


def _cpu_id() -> str:
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()}|{platform.processor()}|{flags}"


def kernel_dir() -> Path:
    return Path(os.environ.get("DOMINO_LAB_CACHE") or Path.home() / ".cache" / "domino_lab").expanduser() / "kernels"


def build() -> Path:
    """Compile head_kernel.cpp (once per source/compiler/CPU) and return the shared library's path."""
    cxx = os.environ.get("CXX") or next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    if not cxx:
        raise RuntimeError("no C++ compiler found (install g++ or set CXX)")
    src = SOURCE.read_bytes()
    errors = []
    for flags in FLAG_SETS:
        key = hashlib.sha256(b"|".join([src, cxx.encode(), " ".join(flags + COMMON).encode(),
                                        _cpu_id().encode()])).hexdigest()[:16]
        out = kernel_dir() / f"head_kernel-{key}.so"
        if out.exists():
            return out
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=out.parent))
        except OSError:       # unwritable cache: build into a private temp dir for this process
            out, tmp = None, Path(tempfile.mkdtemp(prefix="domino-kernel-"))
        so = tmp / "head_kernel.so"
        built = False
        try:
            res = subprocess.run([cxx, *flags, *COMMON, str(SOURCE), "-o", str(so)], capture_output=True,
                                 text=True, timeout=300)
            if res.returncode != 0:
                errors.append(res.stderr.strip().splitlines()[-1] if res.stderr.strip() else f"rc {res.returncode}")
                continue
            built = True
            if out is None:
                return so
            os.replace(so, out)
            return out
        finally:
            if out is not None or not built:     # a private build stays: this process loads it
                shutil.rmtree(tmp, ignore_errors=True)
    raise RuntimeError(f"{cxx} could not build {SOURCE.name}: {'; '.join(errors)}")


def library() -> ctypes.CDLL | None:
    """The loaded kernel, building it on first use; None (after one warning) when it cannot be built."""
    global _lib
    if _lib is None:
        try:
            lib = ctypes.CDLL(str(build()))
            for name in _FUNCS.values():
                fn = getattr(lib, name)
                fn.restype = ctypes.c_int64
                fn.argtypes = [ctypes.c_int64] * 9 + [ctypes.c_void_p] * 13
            for name in _BRANCH_FUNCS.values():
                fn = getattr(lib, name)
                fn.restype = ctypes.c_int64
                fn.argtypes = [ctypes.c_int64] * 7 + [ctypes.c_void_p] * 13
            for name in _SAMPLED_FUNCS.values():
                fn = getattr(lib, name)
                fn.restype = ctypes.c_int64
                fn.argtypes = [ctypes.c_int64] * 8 + [ctypes.c_double] * 2 + [ctypes.c_void_p] * 13
            for name in _TREE_FUNCS.values():
                fn = getattr(lib, name)
                fn.restype = ctypes.c_int64
                fn.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_double] + [ctypes.c_int64] * 5 + [ctypes.c_void_p] * 18
            _lib = lib
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            warnings.warn(f"head_impl='fused' unavailable ({e}); using 'fast' (same drafts, slower)")
            _lib = False
    return _lib or None


@dataclass(frozen=True)
class FusedWeights:
    """The head's constant operands for the loop, with their addresses taken once per weight version (the caller
    rebuilds this whenever a weight changes): per call only the inputs and outputs are converted. Holds no ctypes
    object, so a module that caches it still deep-copies and pickles."""
    fn: str                                   # entry point in the library
    dtype: torch.dtype
    sizes: tuple[int, int, int, int]          # g, r, H, V
    ptrs: tuple[int, int, int, int]           # w1_h, table, w_s, w2
    keep: tuple[torch.Tensor, ...]            # the tensors behind `ptrs`, held alive


def prepare(table, w_s, w1_h, w2) -> FusedWeights | None:
    """Bind the loop to the head's weights (table [V, 3g], w_s [g, r + 3g], w1_h [r, H], w2 [V, r]); None where it
    cannot run: no compiler (warned once), not on the CPU, a dtype other than float32/float64."""
    dtype = table.dtype
    if dtype not in _FUNCS or table.device.type != "cpu" or any(t.dtype != dtype for t in (w_s, w1_h, w2)):
        return None
    lib = library()
    if lib is None:
        return None
    keep = (w1_h.contiguous(), table.contiguous(), w_s.contiguous(), w2.contiguous())
    return FusedWeights(_FUNCS[dtype], dtype, (w_s.shape[0], w1_h.shape[0], w1_h.shape[1], table.shape[0]),
                        tuple(t.data_ptr() for t in keep), keep)


def fused_greedy_rollout(fw: FusedWeights, h, base, anchor, pool: int, vocab_ids=None, topk: int = 5):
    """Greedy drafts with the fused loop for h [b, n, H], base logits [b, n, Vd] over the draft vocabulary (FR-Spec:
    `vocab_ids` [Vd], the vocabulary id of each), anchor [b]. Returns (tokens [b, n] vocabulary ids, final logits
    [b, n, K] over the pool (slot 0: base), pool columns [b, K] as indices into the draft vocabulary or None for the
    whole of it, (ids, values) [b, n, min(topk, K)] of each slot's largest final logits, slot 0 over the whole draft
    vocabulary) -- what domino_head.greedy_rollout computes; None where the inputs cannot go to the loop."""
    dtype, lib = fw.dtype, library()
    if lib is None or base.dtype != dtype or h.dtype != dtype or base.device.type != "cpu":
        return None
    b, n, vd = base.shape
    k = pool if 0 < pool < vd else vd
    kt = max(1, min(topk, k))
    base, h, anchor = base.contiguous(), h.contiguous(), anchor.contiguous()
    if anchor.dtype != torch.long:
        anchor = anchor.long()
    tokens = torch.empty(b, n, dtype=torch.long)
    finals = torch.empty(b, n, k, dtype=dtype)
    ids = torch.empty(b, k if k < vd else 0, dtype=torch.long)
    top_ids, top_vals = torch.empty(b, n, kt, dtype=torch.long), torch.empty(b, n, kt, dtype=dtype)
    vmap = None if vocab_ids is None else vocab_ids.contiguous()
    # every tensor the loop reads through an address is held by a local name until it returns
    if getattr(lib, fw.fn)(b, n, vd, k, *fw.sizes, kt, base.data_ptr(), h.data_ptr(), *fw.ptrs,
             None if vmap is None else vmap.data_ptr(), anchor.data_ptr(), tokens.data_ptr(), finals.data_ptr(),
             ids.data_ptr(), top_ids.data_ptr(), top_vals.data_ptr()):
        raise IndexError(f"anchor ids must lie in [0, {fw.sizes[3]}), got {anchor.tolist()}")
    return tokens, finals, (None if k == vd else ids), (top_ids, top_vals)


def fused_sampled_rollout(fw: FusedWeights, h, base, anchor, temperature: float, top_p: float = 1.0, generator=None,
                          vocab_ids=None, topk: int = 5):
    """Drafts sampled at `temperature` and `top_p` with the fused loop, over the whole draft vocabulary: h [b, n, H],
    base [b, n, Vd] (FR-Spec: `vocab_ids` [Vd]), anchor [b]. One uniform per slot is drawn from `generator` first,
    so a seed reproduces the drafts. Returns (tokens [b, n] vocabulary ids, q [b, n, Vd] float64: the distribution
    over the draft vocabulary each draft was drawn from, (ids, values) [b, n, min(topk, Vd)] of each slot's largest
    final logits); None where the inputs cannot go to the loop."""
    dtype, lib = fw.dtype, library()
    if lib is None or base.dtype != dtype or h.dtype != dtype or base.device.type != "cpu":
        return None
    b, n, vd = base.shape
    kt = max(1, min(topk, vd))
    base, h, anchor = base.contiguous(), h.contiguous(), anchor.long().contiguous()
    uniforms = torch.rand(b, n, generator=generator, dtype=torch.float64)
    tokens = torch.empty(b, n, dtype=torch.long)
    q = torch.empty(b, n, vd, dtype=torch.float64)
    top_ids, top_vals = torch.empty(b, n, kt, dtype=torch.long), torch.empty(b, n, kt, dtype=dtype)
    vmap = None if vocab_ids is None else vocab_ids.contiguous()
    g, r, H, V = fw.sizes
    w1_h, table, w_s, w2 = fw.ptrs
    # every tensor the loop reads through an address is held by a local name until it returns
    if getattr(lib, _SAMPLED_FUNCS[dtype])(b, n, vd, g, r, H, V, kt, 1.0 / temperature, top_p, base.data_ptr(),
                                           h.data_ptr(), w1_h, table, w_s, w2,
                                           None if vmap is None else vmap.data_ptr(), anchor.data_ptr(),
                                           uniforms.data_ptr(), tokens.data_ptr(), q.data_ptr(), top_ids.data_ptr(),
                                           top_vals.data_ptr()):
        raise IndexError(f"anchor ids must lie in [0, {V}), got {anchor.tolist()}")
    return tokens, q, (top_ids, top_vals)


def fused_branch_level(fw: FusedWeights, prev: torch.Tensor, parent: torch.Tensor, tokens: torch.Tensor,
                       hw: torch.Tensor | None, scores: torch.Tensor | None, cols: torch.Tensor | None, kt: int):
    """One level of tree drafting with the loop (domino_head.Branches): node i reads tokens[i] into the state of row
    parent[i] of prev [np, g] (-1: the zero state); with kt > 0 it also scores its children on the K pool columns
    (base `scores` [K], vocabulary ids `cols` [K], W1_H h of the level `hw` [r]). Returns (states [m, g], and for
    kt > 0 the top-kt children per node: log-probabilities over the pool, vocabulary ids, logits, each [m, kt])."""
    lib = library()
    dtype = fw.dtype
    g, r, _, V = fw.sizes
    m, K = tokens.shape[0], (0 if cols is None else cols.shape[0])
    kt = max(0, min(kt, K))
    prev = prev.contiguous()
    parent, tokens = parent.long().contiguous(), tokens.long().contiguous()
    states = torch.empty(m, g, dtype=dtype)
    top_logp, top_vals = torch.empty(m, kt, dtype=dtype), torch.empty(m, kt, dtype=dtype)
    top_ids = torch.empty(m, kt, dtype=torch.long)
    if kt:
        hw, scores, cols = hw.to(dtype).contiguous(), scores.to(dtype).contiguous(), cols.long().contiguous()
    _, table_p, w_s_p, w2_p = fw.ptrs
    # every tensor the loop reads through an address is held by a local name until it returns
    if getattr(lib, _BRANCH_FUNCS[dtype])(m, prev.shape[0], g, r, K, V, kt, prev.data_ptr(), parent.data_ptr(),
                                          tokens.data_ptr(), table_p, w_s_p, hw.data_ptr() if kt else None,
                                          scores.data_ptr() if kt else None, w2_p, cols.data_ptr() if kt else None,
                                          states.data_ptr(), top_logp.data_ptr(), top_ids.data_ptr(),
                                          top_vals.data_ptr()):
        raise IndexError(f"token ids must lie in [0, {V}) and parent rows in [-1, {prev.shape[0]})")
    return states, top_logp, top_ids, top_vals


def fused_best_first(fw: FusedWeights, state0: torch.Tensor, hw: torch.Tensor, scores: torch.Tensor,
                     cols: torch.Tensor, logp0: torch.Tensor, ids0: torch.Tensor, n_nodes: int, depth: int, k: int,
                     krec: int, min_logp: float):
    """The best-first tree of decoding.tree.build_tree over the head's branches in one call of the loop: the
    anchor's state0 [1, g] and its children (log-probabilities logp0, vocabulary ids ids0 [m0], best first), each
    level's W1_H h `hw` [depth, r] and pool scores `scores` [depth, K] on the pool columns `cols` [K] (vocabulary
    ids), k children ranked per node. Returns (tokens, parents, depths, scores of every node created, in creation
    order; the kept nodes' ids, best first; {expanded node id: (its first krec children's vocabulary ids, logits)}
    for the nodes below the anchor), as Python lists."""
    lib = library()
    dtype = fw.dtype
    g, r, _, V = fw.sizes
    K = cols.shape[0]
    kt = max(1, min(k, K))
    krec = min(krec, kt)
    cap = n_nodes * depth
    state0, hw, scores = (t.to(dtype).contiguous() for t in (state0, hw, scores))
    cols, ids0 = cols.long().contiguous(), ids0.long().contiguous()
    logp0 = logp0.double().contiguous()
    tok, par, dep, kept, node = (torch.empty(n, dtype=torch.long) for n in (cap, cap, cap, n_nodes, cap))
    score = torch.empty(cap, dtype=torch.float64)
    top_ids, top_vals = torch.empty(cap, krec, dtype=torch.long), torch.empty(cap, krec, dtype=torch.float64)
    counts = torch.zeros(3, dtype=torch.long)
    _, table_p, w_s_p, w2_p = fw.ptrs
    # every tensor the loop reads through an address is held by a local name until it returns
    if getattr(lib, _TREE_FUNCS[dtype])(n_nodes, depth, kt, krec, min_logp, g, r, K, V, logp0.shape[0],
                                        logp0.data_ptr(), ids0.data_ptr(), state0.data_ptr(), table_p, w_s_p,
                                        hw.data_ptr(), scores.data_ptr(), w2_p, cols.data_ptr(), tok.data_ptr(),
                                        par.data_ptr(), dep.data_ptr(), score.data_ptr(), kept.data_ptr(),
                                        node.data_ptr(), top_ids.data_ptr(), top_vals.data_ptr(), counts.data_ptr()):
        raise IndexError(f"token ids must lie in [0, {V})")
    made, expanded, n_kept = counts.tolist()
    tops = dict(zip(node[:expanded].tolist(), zip(top_ids[:expanded].tolist(), top_vals[:expanded].tolist())))
    return (tok[:made].tolist(), par[:made].tolist(), dep[:made].tolist(), score[:made].tolist(),
            kept[:n_kept].tolist(), tops)
