// The Domino head's greedy rollout as one CPU loop (head_impl = "fused"; docs/design.md#head-inference-paths).
//
// Same arithmetic as domino_head.greedy_rollout: pool = top-K of the per-token max base logit over the block's
// slots; S_0 = GRU(E x_anchor) from a zero state; for every later slot the GRU consumes the previous draft (its
// input gates are a row of the precomputed table E W_ih^T), ΔL = W2 . SiLU(W1_H h + W1_S s) is scored on the pool
// and the draft is the argmax of base + ΔL. Written out by hand because on a CPU the rollout is ~30 tiny ops per
// slot and PyTorch's per-op dispatch (eager) or per-call guards (torch.compile) cost more than the arithmetic.
// Built on first use by head_kernel.py with the system C++ compiler and called through ctypes; no torch headers.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <queue>
#include <tuple>
#include <vector>

namespace {

// exp for the gates. float: range reduction x = n ln2 + r (|r| <= ln2/2, ln2 split in two parts) and a degree-6
// Taylor polynomial (error ~1 ulp), scaled by 2^n through the exponent bits; written out so that the gate loops
// vectorise (libm's scalar expf/tanhf were ~80% of a step's gate time). double (the tests' path): libm.
template <typename T> inline T vexp(T x) { return std::exp(x); }
template <> inline float vexp<float>(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);      // keeps 2^n a normal float
    const float n = std::floor(x * 1.44269504088896341f + 0.5f);
    const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
    const float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.66666672e-1f + r * (4.16666679e-2f +
                    r * (8.33333377e-3f + r * 1.38888892e-3f)))));
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}
template <typename T> inline T sigmoid(T x) { return T(1) / (T(1) + vexp(-x)); }
template <typename T> inline T vtanh(T x) { return T(2) / (T(1) + vexp(T(-2) * x)) - T(1); }

// One bias-free GRU step in PyTorch's gate order (r, z, n) from input gates gi = W_ih x [3g] and recurrent gates
// gh = W_hh s_prev [3g]: s = n + z (s_prev - n). gh == nullptr is the zero previous state (the recurrent terms
// vanish). `s` may alias `s_prev`.
template <typename T> inline void gru_step(const T* gi, const T* gh, const T* s_prev, T* s, int64_t g) {
    if (gh == nullptr) {
#pragma omp simd
        for (int64_t j = 0; j < g; ++j) {
            const T nn = vtanh(gi[2 * g + j]);
            s[j] = nn - sigmoid(gi[g + j]) * nn;
        }
        return;
    }
#pragma omp simd
    for (int64_t j = 0; j < g; ++j) {
        const T rg = sigmoid(gi[j] + gh[j]);
        const T zg = sigmoid(gi[g + j] + gh[g + j]);
        const T nn = vtanh(gi[2 * g + j] + rg * gh[2 * g + j]);
        s[j] = nn + zg * (s_prev[j] - nn);
    }
}

// The k largest of m[0..V) as indices, in descending order of value (a min-heap of size k, then heap-sort).
template <typename T> void topk_desc(const T* m, int64_t V, int64_t k, int64_t* idx, T* val) {
    auto sift = [&](int64_t i, int64_t size) {
        for (;;) {
            int64_t l = 2 * i + 1, s = i;
            if (l < size && val[l] < val[s]) s = l;
            if (l + 1 < size && val[l + 1] < val[s]) s = l + 1;
            if (s == i) return;
            T tv = val[i]; val[i] = val[s]; val[s] = tv;
            int64_t ti = idx[i]; idx[i] = idx[s]; idx[s] = ti;
            i = s;
        }
    };
    for (int64_t v = 0; v < k; ++v) { val[v] = m[v]; idx[v] = v; }
    for (int64_t i = k / 2 - 1; i >= 0; --i) sift(i, k);
    for (int64_t v = k; v < V; ++v) {
        if (m[v] > val[0]) { val[0] = m[v]; idx[0] = v; sift(0, k); }
    }
    for (int64_t size = k - 1; size > 0; --size) {   // pop the minimum to the end: descending order
        T tv = val[0]; val[0] = val[size]; val[size] = tv;
        int64_t ti = idx[0]; idx[0] = idx[size]; idx[size] = ti;
        sift(0, size);
    }
}

// The kt largest of x[0..N) in descending order (insertion: kt is small), as ids id(k) and values. Strict `>`
// keeps the earliest of equal values first, so ids[0] is the argmax as torch.argmax picks it.
template <typename T, typename Id> void top_small(const T* x, int64_t N, int64_t kt, Id id, int64_t* ids, T* vals) {
    int64_t cnt = 0;
    for (int64_t k = 0; k < N; ++k) {
        const T v = x[k];
        if (cnt == kt && !(v > vals[kt - 1])) continue;
        int64_t p = cnt < kt ? cnt++ : kt - 1;
        for (; p > 0 && v > vals[p - 1]; --p) { vals[p] = vals[p - 1]; ids[p] = ids[p - 1]; }
        vals[p] = v;
        ids[p] = id(k);
    }
}

// out[c] = sum_j s[j] W[j, c] for c < C, W [g, ld] row-major. Computed in blocks of 64 columns held in registers
// over all j (each output still sums j in order). W = [W1_S ; W_hh]^T is larger than a core's L2 on small CPUs, so
// every step streams it from L3: walking the blocks in the opposite direction on alternate steps starts each pass on
// the blocks the previous one left in L2. C < ld computes only the leading columns (the last slot needs W1_S s, not
// the next step's gates W_hh s).
template <typename T> void vecmat(const T* __restrict__ s, const T* __restrict__ W, int64_t g, int64_t ld,
                                  int64_t C, T* __restrict__ out, bool backwards) {
    constexpr int64_t CB = 64;
    const int64_t nb = (C + CB - 1) / CB;
    for (int64_t t = 0; t < nb; ++t) {
        const int64_t c0 = (backwards ? nb - 1 - t : t) * CB;
        const T* w = W + c0;
        if (c0 + CB <= C) {
            T acc[CB] = {};
            for (int64_t j = 0; j < g; ++j, w += ld) {
                const T sj = s[j];
                for (int64_t c = 0; c < CB; ++c) acc[c] += sj * w[c];
            }
            for (int64_t c = 0; c < CB; ++c) out[c0 + c] = acc[c];
        } else {                                    // a last, partial block
            const int64_t nc = C - c0;
            for (int64_t c = 0; c < nc; ++c) out[c0 + c] = T(0);
            for (int64_t j = 0; j < g; ++j, w += ld)
                for (int64_t c = 0; c < nc; ++c) out[c0 + c] += s[j] * w[c];
        }
    }
}

// Slot i >= 1: feed the previous draft to the GRU (its recurrent gates W_hh s are proj[r:]), refresh
// proj = s . [W1_S ; W_hh]^T (the recurrent part only while a later slot needs it) and form the correction's input
// u = SiLU(W1_H h_i + W1_S s) [r].
template <typename T>
inline void advance(int64_t tok, int64_t i, int64_t n, int64_t g, int64_t r, int64_t H, const T* table, const T* w_s,
                    const T* w1_h, const T* hi, T* s, T* proj, T* u) {
    const int64_t C = r + 3 * g;
    gru_step(table + tok * 3 * g, proj + r, s, s, g);
    vecmat(s, w_s, g, C, i + 1 < n ? C : r, proj, i % 2 == 1);
    for (int64_t j = 0; j < r; ++j) {
        const T* w = w1_h + j * H;
        T x = proj[j];
#pragma omp simd reduction(+ : x)
        for (int64_t c = 0; c < H; ++c) x += w[c] * hi[c];
        u[j] = x * sigmoid(x);
    }
}

// Returns 0, or 1 when an anchor id lies outside the table (nothing is read out of bounds).
template <typename T>
int64_t rollout(int64_t b, int64_t n, int64_t Vd, int64_t K, int64_t g, int64_t r, int64_t H, int64_t V, int64_t kt,
                const T* base, const T* h, const T* w1_h, const T* table, const T* w_s, const T* w2,
                const int64_t* vmap, const int64_t* anchor, int64_t* tokens, T* finals, int64_t* pool,
                int64_t* top_ids, T* top_vals) {
    for (int64_t bi = 0; bi < b; ++bi)
        if (anchor[bi] < 0 || anchor[bi] >= V) return 1;
    const int64_t C = r + 3 * g;
    std::vector<T> scratch(Vd + K + g + C + r);   // per call: concurrent callers never share it
    T* m = scratch.data();    // [Vd] per-token max over slots
    T* heap = m + Vd;         // [K]
    T* s = heap + K;          // [g] GRU state
    T* proj = s + g;          // [C] s . [W1_S ; W_hh]^T
    T* u = proj + C;          // [r]
    const bool full = K == Vd;
    for (int64_t bi = 0; bi < b; ++bi) {
        const T* B = base + bi * n * Vd;
        int64_t* P = pool + bi * K;
        if (!full) {
            for (int64_t v = 0; v < Vd; ++v) m[v] = B[v];
            for (int64_t i = 1; i < n; ++i)
                for (int64_t v = 0; v < Vd; ++v) m[v] = B[i * Vd + v] > m[v] ? B[i * Vd + v] : m[v];
            topk_desc(m, Vd, K, P, heap);
        }
        auto col = [&](int64_t k) { return full ? k : P[k]; };          // pool column -> draft-vocab index
        auto vid = [&](int64_t d) { return vmap ? vmap[d] : d; };       // draft-vocab index -> vocabulary id
        // draft 0 is uncorrected: the argmax of the full base logits (its final top-k is the base top-k)
        int64_t* TI = top_ids + bi * n * kt;
        T* TV = top_vals + bi * n * kt;
        top_small(B, Vd, kt, vid, TI, TV);
        int64_t tok = TI[0];
        tokens[bi * n] = tok;
        T* F = finals + bi * n * K;
        for (int64_t k = 0; k < K; ++k) F[k] = B[col(k)];
        // the state that has consumed the anchor (zero previous state: the recurrent terms vanish)
        gru_step<T>(table + anchor[bi] * 3 * g, nullptr, nullptr, s, g);
        vecmat(s, w_s, g, C, n > 1 ? C : r, proj, false);
        for (int64_t i = 1; i < n; ++i) {
            advance(tok, i, n, g, r, H, table, w_s, w1_h, h + (bi * n + i) * H, s, proj, u);
            const T* Bi = B + i * Vd;
            T* Fi = F + i * K;
            for (int64_t k = 0; k < K; ++k) {
                const int64_t d = col(k);
                const T* w = w2 + vid(d) * r;
                T acc = T(0);
#pragma omp simd reduction(+ : acc)
                for (int64_t j = 0; j < r; ++j) acc += u[j] * w[j];
                Fi[k] = Bi[d] + acc;
            }
            top_small(Fi, K, kt, [&](int64_t k) { return vid(col(k)); }, TI + i * kt, TV + i * kt);
            tok = TI[i * kt];
            tokens[bi * n + i] = tok;
        }
    }
    return 0;
}

// The same rollout sampled at temperature 1/inv_temp over the whole draft vocabulary (no pool: a sample needs q's
// full support): every slot's final logits L (slot 0: the base), q = softmax(L inv_temp) in double, cut to its
// top-p nucleus as sampling.warp_probs does (the largest probabilities while the mass before them is < top_p, and
// any tied with the smallest of them, renormalised), and the draft is the first index whose running sum of q
// exceeds the slot's uniform u (inverse CDF; u drawn by the caller from its generator, so a seed reproduces the
// drafts). q comes out as drawn from: [b, n, Vd] over the draft vocabulary. A u at or above the sum (rounding)
// takes the last index with q > 0.
template <typename T>
int64_t rollout_sampled(int64_t b, int64_t n, int64_t Vd, int64_t g, int64_t r, int64_t H, int64_t V, int64_t kt,
                        double inv_temp, double top_p, const T* base, const T* h, const T* w1_h, const T* table,
                        const T* w_s, const T* w2, const int64_t* vmap, const int64_t* anchor,
                        const double* uniforms, int64_t* tokens, double* q, int64_t* top_ids, T* top_vals) {
    for (int64_t bi = 0; bi < b; ++bi)
        if (anchor[bi] < 0 || anchor[bi] >= V) return 1;
    const int64_t C = r + 3 * g;
    std::vector<T> scratch(Vd + g + C + r);
    std::vector<double> desc(top_p < 1.0 ? Vd : 0);
    T* L = scratch.data();    // [Vd] this slot's final logits
    T* s = L + Vd;            // [g] GRU state
    T* proj = s + g;          // [C]
    T* u = proj + C;          // [r]
    auto vid = [&](int64_t d) { return vmap ? vmap[d] : d; };
    for (int64_t bi = 0; bi < b; ++bi) {
        const T* B = base + bi * n * Vd;
        int64_t tok = 0;
        for (int64_t i = 0; i < n; ++i) {
            const T* Bi = B + i * Vd;
            if (i == 0) {
                for (int64_t d = 0; d < Vd; ++d) L[d] = Bi[d];
                gru_step<T>(table + anchor[bi] * 3 * g, nullptr, nullptr, s, g);
                vecmat(s, w_s, g, C, n > 1 ? C : r, proj, false);
            } else {
                advance(tok, i, n, g, r, H, table, w_s, w1_h, h + (bi * n + i) * H, s, proj, u);
                for (int64_t d = 0; d < Vd; ++d) {
                    const T* w = w2 + vid(d) * r;
                    T acc = T(0);
#pragma omp simd reduction(+ : acc)
                    for (int64_t j = 0; j < r; ++j) acc += u[j] * w[j];
                    L[d] = Bi[d] + acc;
                }
            }
            top_small(L, Vd, kt, vid, top_ids + (bi * n + i) * kt, top_vals + (bi * n + i) * kt);
            double* Q = q + (bi * n + i) * Vd;
            const double mx = double(top_vals[(bi * n + i) * kt]);
            double sum = 0.0;
            for (int64_t d = 0; d < Vd; ++d) sum += (Q[d] = std::exp((double(L[d]) - mx) * inv_temp));
            if (top_p < 1.0) {           // the nucleus: every q >= the smallest q kept (ties kept together)
                std::copy(Q, Q + Vd, desc.begin());
                std::sort(desc.begin(), desc.end(), [](double a, double c) { return a > c; });
                const double mass = top_p * sum;              // (in the unnormalised units of Q)
                double before = 0.0, cut = desc[0];
                for (int64_t k = 0; k < Vd && before < mass; ++k) {
                    cut = desc[k];
                    before += desc[k];
                }
                sum = 0.0;
                for (int64_t d = 0; d < Vd; ++d) sum += (Q[d] = Q[d] >= cut ? Q[d] : 0.0);
            }
            const double target = uniforms[bi * n + i];
            double run = 0.0;
            int64_t pick = -1, last = 0;
            for (int64_t d = 0; d < Vd; ++d) {
                Q[d] /= sum;
                if (Q[d] > 0.0) last = d;
                run += Q[d];
                if (pick < 0 && run > target && Q[d] > 0.0) pick = d;
            }
            tok = vid(pick < 0 ? last : pick);
            tokens[bi * n + i] = tok;
        }
    }
    return 0;
}

// One level of tree drafting (domino_head.Branches): node i reads its own token into its parent's state (row
// parent[i] of prev [np, g]; -1 = the zero state) and, when kt > 0, scores its children on the pool: the K columns'
// final logits scores[k] + W2[cols[k]] . SiLU(hw + W1_S s_i), of which the kt largest come out as (vocabulary id,
// logit, log-probability under the softmax over the K columns). W_hh s is computed once per distinct parent: most
// nodes of a best-first tree are leaves whose parents are shared. Returns 0, or 1 for an index out of range.
template <typename T>
int64_t branch_level(int64_t m, int64_t np, int64_t g, int64_t r, int64_t K, int64_t V, int64_t kt, const T* prev,
                     const int64_t* parent, const int64_t* tokens, const T* table, const T* w_s, const T* hw,
                     const T* scores, const T* w2, const int64_t* cols, T* states, T* top_logp, int64_t* top_ids,
                     T* top_vals) {
    for (int64_t i = 0; i < m; ++i)
        if (tokens[i] < 0 || tokens[i] >= V || parent[i] < -1 || parent[i] >= np) return 1;
    for (int64_t k = 0; kt > 0 && k < K; ++k)
        if (cols[k] < 0 || cols[k] >= V) return 1;
    const int64_t C = r + 3 * g;
    std::vector<T> gh(np * 3 * g), proj(r), u(r), logits(K);
    std::vector<char> have(np, 0);
    for (int64_t i = 0; i < m; ++i) {
        const int64_t p = parent[i];
        const T* gi = table + tokens[i] * 3 * g;
        T* s = states + i * g;
        if (p < 0) {
            gru_step<T>(gi, nullptr, nullptr, s, g);
        } else {
            T* ghp = gh.data() + p * 3 * g;
            const T* sp = prev + p * g;
            if (!have[p]) { vecmat(sp, w_s + r, g, C, 3 * g, ghp, false); have[p] = 1; }
            gru_step<T>(gi, ghp, sp, s, g);
        }
        if (kt <= 0) continue;
        vecmat(s, w_s, g, C, r, proj.data(), false);            // W1_S s: the leading r columns
        for (int64_t j = 0; j < r; ++j) {
            const T x = hw[j] + proj[j];
            u[j] = x * sigmoid(x);
        }
        T mx = -INFINITY;
        for (int64_t k = 0; k < K; ++k) {
            const T* w = w2 + cols[k] * r;
            T acc = T(0);
#pragma omp simd reduction(+ : acc)
            for (int64_t j = 0; j < r; ++j) acc += u[j] * w[j];
            logits[k] = scores[k] + acc;
            mx = logits[k] > mx ? logits[k] : mx;
        }
        double sum = 0.0;                            // log-sum-exp in double: ranking across parents uses it
        for (int64_t k = 0; k < K; ++k) sum += std::exp(double(logits[k] - mx));
        const T lse = mx + T(std::log(sum));
        int64_t* ti = top_ids + i * kt;
        T* tv = top_vals + i * kt;
        top_small(logits.data(), K, kt, [&](int64_t k) { return cols[k]; }, ti, tv);
        for (int64_t k = 0; k < kt; ++k) top_logp[i * kt + k] = tv[k] - lse;
    }
    return 0;
}

// The whole best-first tree of tree.build_tree over the head's branches, in one call: the anchor's children are
// given (m0 of them, sorted, from the uncorrected slot 0), then each level runs branch_level over the frontier (the
// kept nodes at the deepest depth) and merges the kept nodes with every frontier node's sorted children, exactly as
// build_tree does (a min-heap on (-score, parent row, rank); a tie keeps the older node), so a level costs no Python.
// Scores are sums of log-probabilities in double, as build_tree's, of the children's float32 values whatever T (as
// sampling.top_children gives them). Nodes are numbered in creation order (at most n_nodes a level); `kept` lists
// the final nodes best first; every expanded node below the anchor records its first krec children (top_node /
// top_ids / top_vals). counts = (nodes created, nodes expanded, nodes kept).
template <typename T>
int64_t best_first(int64_t n_nodes, int64_t depth, int64_t kt, int64_t krec, double min_logp, int64_t g, int64_t r,
                   int64_t K, int64_t V, int64_t m0, const double* logp0, const int64_t* ids0, const T* state0,
                   const T* table, const T* w_s, const T* hw, const T* scores, const T* w2, const int64_t* cols,
                   int64_t* tok, int64_t* par, int64_t* dep, double* score, int64_t* kept_out, int64_t* top_node,
                   int64_t* top_ids, double* top_vals, int64_t* counts) {
    using Entry = std::tuple<double, int64_t, int64_t>;          // (-score, parent row, rank among its children)
    int64_t created = 0, expanded = 0;
    std::vector<int64_t> kept, merged, frontier{-1}, rows, toks, row_of(n_nodes * depth, 0);
    std::vector<T> prev(state0, state0 + g), states, tl, tv;
    std::vector<int64_t> ti;
    std::vector<double> base;
    for (int64_t level = 0; level < depth; ++level) {
        const int64_t f = static_cast<int64_t>(frontier.size());
        int64_t kc = m0;
        if (level > 0) {
            rows.resize(f);
            toks.resize(f);
            for (int64_t i = 0; i < f; ++i) {
                rows[i] = par[frontier[i]] < 0 ? 0 : row_of[par[frontier[i]]];
                toks[i] = tok[frontier[i]];
            }
            states.resize(f * g);
            tl.resize(f * kt);
            tv.resize(f * kt);
            ti.resize(f * kt);
            if (branch_level<T>(f, static_cast<int64_t>(prev.size()) / g, g, r, K, V, kt, prev.data(), rows.data(),
                                toks.data(), table, w_s, hw + level * r, scores + level * K, w2, cols, states.data(),
                                tl.data(), ti.data(), tv.data()))
                return 1;
            for (int64_t i = 0; i < f; ++i, ++expanded) {
                top_node[expanded] = frontier[i];
                row_of[frontier[i]] = i;
                for (int64_t j = 0; j < krec; ++j) {
                    top_ids[expanded * krec + j] = j < kt ? ti[i * kt + j] : -1;
                    top_vals[expanded * krec + j] = j < kt ? double(float(tv[i * kt + j])) : 0.0;
                }
            }
            prev.swap(states);
            kc = kt;
        }
        auto logp = [&](int64_t row, int64_t j) { return level == 0 ? logp0[j] : double(float(tl[row * kt + j])); };
        base.resize(f);
        std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
        for (int64_t i = 0; i < f; ++i) {
            base[i] = frontier[i] < 0 ? 0.0 : score[frontier[i]];
            if (kc > 0) heap.emplace(-(base[i] + logp(i, 0)), i, 0);
        }
        merged.clear();
        size_t at = 0;
        while (static_cast<int64_t>(merged.size()) < n_nodes && (at < kept.size() || !heap.empty())) {
            if (at < kept.size() && (heap.empty() || score[kept[at]] >= -std::get<0>(heap.top()))) {
                merged.push_back(kept[at++]);
                continue;
            }
            const auto [neg, i, j] = heap.top();
            heap.pop();
            if (-neg < min_logp) {          // the best candidate left is below the floor: so is every other
                heap = {};
                continue;
            }
            merged.push_back(created);
            tok[created] = level == 0 ? ids0[j] : ti[i * kt + j];
            par[created] = frontier[i];
            dep[created] = level + 1;
            score[created] = -neg;
            ++created;
            if (j + 1 < kc) heap.emplace(-(base[i] + logp(i, j + 1)), i, j + 1);
        }
        kept.swap(merged);
        frontier.clear();
        for (int64_t node : kept)
            if (dep[node] == level + 1) frontier.push_back(node);
        if (frontier.empty()) break;
    }
    std::copy(kept.begin(), kept.end(), kept_out);
    counts[0] = created;
    counts[1] = expanded;
    counts[2] = static_cast<int64_t>(kept.size());
    return 0;
}

}  // namespace

// The entry points head_kernel.py binds; all tensors contiguous: base [b, n, Vd], h [b, n, H], w1_h [r, H],
// table [V, 3g], w_s [g, r + 3g], w2 [V, r], vmap [Vd] or null, anchor [b]; out: tokens [b, n], finals [b, n, K],
// pool [b, K], top_ids / top_vals [b, n, kt] (vocabulary ids).
#define DOMINO_ENTRY(NAME, T)                                                                                       \
    int64_t NAME(int64_t b, int64_t n, int64_t Vd, int64_t K, int64_t g, int64_t r, int64_t H, int64_t V,         \
                 int64_t kt, const T* base, const T* h, const T* w1_h, const T* table, const T* w_s, const T* w2, \
                 const int64_t* vmap, const int64_t* anchor, int64_t* tokens, T* finals, int64_t* pool,          \
                 int64_t* top_ids, T* top_vals) {                                                                 \
        return rollout<T>(b, n, Vd, K, g, r, H, V, kt, base, h, w1_h, table, w_s, w2, vmap, anchor, tokens,       \
                          finals, pool, top_ids, top_vals);                                                       \
    }
// branch_level: prev [np, g], parent / tokens [m], hw [r], scores [K], cols [K] (vocabulary ids); out: states
// [m, g], top_logp / top_ids / top_vals [m, kt].
#define BRANCH_ENTRY(NAME, T)                                                                                      \
    int64_t NAME(int64_t m, int64_t np, int64_t g, int64_t r, int64_t K, int64_t V, int64_t kt, const T* prev,     \
                 const int64_t* parent, const int64_t* tokens, const T* table, const T* w_s, const T* hw,          \
                 const T* scores, const T* w2, const int64_t* cols, T* states, T* top_logp, int64_t* top_ids,      \
                 T* top_vals) {                                                                                    \
        return branch_level<T>(m, np, g, r, K, V, kt, prev, parent, tokens, table, w_s, hw, scores, w2, cols,      \
                               states, top_logp, top_ids, top_vals);                                               \
    }
// rollout_sampled: the rollout's operands without the pool, inv_temp, top_p, uniforms [b, n] (double); out:
// tokens [b, n], q [b, n, Vd] (double), top_ids / top_vals [b, n, kt].
#define SAMPLED_ENTRY(NAME, T)                                                                                     \
    int64_t NAME(int64_t b, int64_t n, int64_t Vd, int64_t g, int64_t r, int64_t H, int64_t V, int64_t kt,        \
                 double inv_temp, double top_p, const T* base, const T* h, const T* w1_h, const T* table,          \
                 const T* w_s, const T* w2, const int64_t* vmap, const int64_t* anchor, const double* uniforms,    \
                 int64_t* tokens, double* q, int64_t* top_ids, T* top_vals) {                                      \
        return rollout_sampled<T>(b, n, Vd, g, r, H, V, kt, inv_temp, top_p, base, h, w1_h, table, w_s, w2, vmap,  \
                                  anchor, uniforms, tokens, q, top_ids, top_vals);                                 \
    }
// best_first: logp0 / ids0 [m0] (the anchor's children, best first), state0 [g] (the anchor's GRU state), hw [depth, r],
// scores [depth, K], cols [K]; out: tok / par / dep / score [n_nodes * depth], kept [n_nodes],
// top_node [n_nodes * depth], top_ids / top_vals [n_nodes * depth, krec], counts [3].
#define TREE_ENTRY(NAME, T)                                                                                        \
    int64_t NAME(int64_t n_nodes, int64_t depth, int64_t kt, int64_t krec, double min_logp, int64_t g, int64_t r,  \
                 int64_t K, int64_t V, int64_t m0, const double* logp0, const int64_t* ids0, const T* state0,      \
                 const T* table, const T* w_s, const T* hw, const T* scores, const T* w2, const int64_t* cols,      \
                 int64_t* tok, int64_t* par, int64_t* dep, double* score, int64_t* kept, int64_t* top_node,         \
                 int64_t* top_ids, double* top_vals, int64_t* counts) {                                             \
        return best_first<T>(n_nodes, depth, kt, krec, min_logp, g, r, K, V, m0, logp0, ids0, state0, table, w_s,  \
                             hw, scores, w2, cols, tok, par, dep, score, kept, top_node, top_ids, top_vals, counts);  \
    }
extern "C" {
DOMINO_ENTRY(domino_rollout_f32, float)
DOMINO_ENTRY(domino_rollout_f64, double)
BRANCH_ENTRY(domino_branches_f32, float)
BRANCH_ENTRY(domino_branches_f64, double)
SAMPLED_ENTRY(domino_sampled_f32, float)
SAMPLED_ENTRY(domino_sampled_f64, double)
TREE_ENTRY(domino_tree_f32, float)
TREE_ENTRY(domino_tree_f64, double)
}
