// Segment-batch attention for XLA:CPU, fused: the CPU kernel of akv_jax.kernels.cpu.attention.
//
// Same semantics as akv_jax/pallas/reference.py (the module's tests compare them); the work
// follows the visible KV like chunked.py: each query block reads only its segment's compacted
// visible pages (plan.py's PagePlan) straight from the paged pool, 64 keys a tile, with an
// online softmax whose scores, exponentials and probabilities stay in registers and a few
// KB of stack. A jnp loop cannot do that on the CPU: XLA runs each element-wise pass of the
// softmax over memory, which cost more than both matmuls (chunked.py's notes).
//
// One work item is (query block, kv head): its G query heads x q_len rows against the
// block's keys. Items run on XLA's intra-op thread pool, largest (latest causal) first.
// Vectors are GCC vector extensions of the CPU's own width (vec.h, -march=native): 16
// floats with AVX-512, 8 with AVX2.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "pool.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using akv::splat;
using akv::vf;
using akv::vload;
using akv::vstore;
using akv::W;

// Keys per tile: the per-row softmax work is paid per tile, but a prefill block's row tiles
// all re-read the tile's keys and values, which at 64 keys (2 x 16 KB) stay in L1.
constexpr int TK = 64;
constexpr int KV = TK / W;      // vectors per tile row of scores
// Query rows per register tile, and the vectors per pass of each product: the score
// product keeps RT x QK_V accumulators, the value product RT x PV_V (0: all of the head),
// and with the loaded vectors and a broadcast they must fit the vector registers (AVX-512's
// 32; AVX2's 16, where a whole 64-wide head, 8 vectors a row, spilled). 12 accumulators on
// AVX2 rather than 8: a fused multiply-add's latency is 4 cycles on two pipes, so 8 chains
// just cover it, and each step's 2 vector loads and RT broadcasts feed 12 multiply-adds.
// AVX-512: 6 rows x the whole 64-key tile (4 vectors) is 24 accumulators, with the 4 key
// vectors and a broadcast 29 of 32 registers; each d step's 4 loads and 6 broadcasts feed
// 24 multiply-adds (4 rows: 16). Figures: docs/cpu-kernels.md.
#ifdef __AVX512F__
constexpr int RT = 6;
constexpr int QK_V = 4;
constexpr int PV_V = 0;
#else
constexpr int RT = 6;
constexpr int QK_V = 2;
constexpr int PV_V = 2;
#endif
// A block of at most this many rows (a decode step: one token's G query heads) runs one
// tile of exactly its rows (attend's switch), with no padding rows to compute.
constexpr int RT_FEW = 4;
constexpr int RT_MAX = RT > RT_FEW ? RT : RT_FEW;
static_assert(KV % QK_V == 0, "the score passes cover the tile's key vectors exactly");
constexpr int BLK_FIELDS = 6;   // seg, q_start, q_len, kv_pos, lo, hi
// Keys per chunk: a row's softmax runs per chunk of the view's visible keys (chunk c holds
// visible indices [c * CH, (c + 1) * CH)) and the chunks fold in order. Their bounds depend
// on the view alone, so a row's bits are the same whether one item ran all of its chunks
// or, when a step has fewer items than threads (one long decode), each chunk ran on its own.
constexpr int64_t CH = 1024;
static_assert(CH % TK == 0, "chunks hold whole tiles");

using akv::hmax;
using akv::hsum;
using akv::splati;
using akv::vi;
using akv::vexp;
using akv::viload;

struct Problem {
  const float* q;        // [T, Hq, Dh]
  const float* k;        // this layer's pool [P, ps, Hkv, Dh]
  const float* v;
  const int32_t* pages;  // [S, MPp] compacted visible pages per segment
  const int32_t* order;   // [S, MPp] view page of each compacted page
  const bool* kv_vis;     // [S, N] the view's slots a segment may attend
  const int32_t* kv_len;  // [S] slots in the segment's view
  const int32_t* rank;    // [S, MPp + 1] visible slots before each compacted page
  const int32_t* blk;    // [NB, BLK_FIELDS]
  const int32_t* win;    // [NB, block_q] window start per row, or null
  const float* sinks;    // [Hq] or null
  float* out;            // [T, Hq, Dh]
  int64_t T, Hq, Hkv, G, Dh, ps, MPp, N, block_q;
  float sm_scale;
};

// Folds chunk state (mc, lc, accc) into a row's running state (m, l, acc). One compiled
// body for every caller, so that a chunk folds to the same bits wherever it ran.
__attribute__((noinline)) void fold(int64_t dh, float* m, float* l, float* acc, float mc,
                                    float lc, const float* accc) {
  if (!(mc > -std::numeric_limits<float>::infinity())) return;  // the chunk saw nothing
  const float mn = std::max(*m, mc);
  const float a = *m == mn ? 1.f : std::exp(*m - mn);  // 0 when nothing was seen yet
  const float c = mc == mn ? 1.f : std::exp(mc - mn);
  *l = *l * a + lc * c;
  const vf av = splat(a), cv = splat(c);
  for (int64_t d = 0; d < dh; d += W) vstore(acc + d, vload(acc + d) * av + vload(accc + d) * cv);
  *m = mn;
}

// A row's starting state: its sink (one more logit with no value) or nothing seen.
inline void start_row(const Problem& pb, int64_t hq, float* m, float* l) {
  *m = pb.sinks ? pb.sinks[hq] : -std::numeric_limits<float>::infinity();
  *l = pb.sinks ? 1.f : 0.f;
}

// The output rows of (block b, kv head h) from their final states.
__attribute__((noinline)) void finish(const Problem& pb, int64_t b, int64_t h, const float* l,
                                      const float* acc) {
  const int32_t* bk = pb.blk + b * BLK_FIELDS;
  const int64_t q_start = bk[1], R = int64_t(bk[2]) * pb.G, Dh = pb.Dh;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t i = r / pb.G, g = r % pb.G;
    float* dst = pb.out + ((q_start + i) * pb.Hq + h * pb.G + g) * Dh;
    const float inv = 1.f / std::max(l[r], 1e-30f);
    for (int64_t d = 0; d < Dh; ++d) dst[d] = acc[r * Dh + d] * inv;
  }
}

// The view index of compacted slot (pg, off) of a segment (its pages' view order ``order``,
// its visible slots ``vis`` of ``len``), or -1 when the view hides it.
inline int64_t view_index(const int32_t* order, const bool* vis, int64_t len, int64_t ps,
                          int64_t pg, int64_t off) {
  const int64_t vs = int64_t(order[pg]) * ps + off;
  return vs < len && vis[vs] ? vs : -1;
}

// The chunks [c0, c1) that block b's keys fall in (by visible index).
inline void chunk_range(const Problem& pb, int64_t b, int64_t* c0, int64_t* c1) {
  const int32_t* bk = pb.blk + b * BLK_FIELDS;
  if (bk[0] < 0) {
    *c0 = *c1 = 0;
    return;
  }
  const int32_t* rank = pb.rank + int64_t(bk[0]) * (pb.MPp + 1);
  const int64_t lo = rank[bk[4]], hi = rank[bk[5]];
  *c0 = lo / CH;
  *c1 = hi > lo ? (hi + CH - 1) / CH : *c0;
}

// Rows a partial state holds per (block, kv head, chunk): a block's rows, padded.
inline int64_t partial_rows(const Problem& pb) { return pb.block_q * pb.G; }

// One (block, kv head) item over chunks [c0, c1) of its keys. Without ``partial`` it folds
// them into the rows' states and writes the output; with it, it runs one chunk (c1 = c0 + 1)
// and leaves that chunk's state there ([m, l, acc[Dh]] a row) for :func:`Impl` to fold.
// NV: Dh / W vectors per head row.
template <int NV>
void attend(const Problem& pb, int64_t b, int64_t h, int64_t c0, int64_t c1, float* partial) {
  const int32_t* bk = pb.blk + b * BLK_FIELDS;
  const int32_t seg = bk[0], q_start = bk[1], q_len = bk[2], kv_pos = bk[3];
  const int64_t lo = bk[4], hi = bk[5];
  if (seg < 0 || q_len <= 0) return;
  const int64_t G = pb.G, Dh = NV * W, Hq = pb.Hq, ps = pb.ps;
  const int64_t R = int64_t(q_len) * G;               // real rows: (i, g) -> i * G + g
  // Padded to whole register tiles.
  const int64_t Rp = std::max<int64_t>((R + RT - 1) / RT * RT, RT_FEW);

  // The chunk's state (m, l, acc: what the tiles update) and the rows' running state.
  std::vector<float> qs(Rp * Dh, 0.f), acc(Rp * Dh), m(Rp), l(Rp);
  std::vector<float> run_acc(Rp * Dh, 0.f), run_m(Rp), run_l(Rp);
  std::vector<int32_t> pos(Rp, -1), wlo(Rp, 0);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t i = r / G, g = r % G, hq = h * G + g;
    const float* src = pb.q + ((q_start + i) * Hq + hq) * Dh;
    for (int64_t d = 0; d < Dh; ++d) qs[r * Dh + d] = src[d] * pb.sm_scale;
    pos[r] = kv_pos + int32_t(i);
    if (pb.win) wlo[r] = pb.win[b * pb.block_q + i];
    start_row(pb, hq, &run_m[r], &run_l[r]);
  }

  // Every row scores a key the same way, one multiply-add chain over the head (keys
  // transposed, a vector of keys at a time), whatever the row count: a token's attention has
  // the same bits in a decode step and in a prefill (issue 38, bit for bit).
  alignas(64) float kt[NV * W * TK];  // keys transposed: [Dh][TK] (many rows)
  alignas(64) int32_t sp[TK];
  alignas(64) float p[RT_MAX * TK];  // a row tile's scores, then its probabilities
  alignas(64) static const float zeros[NV * W] = {};
  const float* kp[TK];  // each key's and value's row in the pool; zeros where masked
  const float* vp[TK];  // (a masked slot may hold NaN, and 0 * NaN is NaN)
  const int32_t* seg_pages = pb.pages + int64_t(seg) * pb.MPp;
  // A compacted slot's view index: its page's view page, its offset; masked (-1) when the
  // view hides it. Found here, per key read, rather than planned for every slot of every
  // padded segment before the call.
  const int32_t* seg_order = pb.order + int64_t(seg) * pb.MPp;
  const bool* seg_vis = pb.kv_vis + int64_t(seg) * pb.N;
  const int64_t seg_len = pb.kv_len[seg];
  const int64_t stride = pb.Hkv * Dh;  // between consecutive slots of a page
  const vf neg_inf = splat(-std::numeric_limits<float>::infinity());
  int32_t max_pos = kv_pos + q_len - 1;
  int64_t nk = 0;        // the current tile's keys
  bool dense = false;    // all TK of them hold a key (none masked by position yet)
  int32_t smin = 0, smax = 0;  // their view positions' range, when dense
  vi spv[KV];

  // NT query rows from r0 against the current tile: scores, the online softmax, and the
  // probabilities times the values into the rows' accumulators.
  auto row_tile = [&](auto nt_tag, int64_t r0) {
    constexpr int NT = decltype(nt_tag)::value;
    const float* qr = qs.data() + r0 * Dh;
    // Scores of NT rows x TK keys, QK_V key vectors at a time: NT * QK_V accumulators in
    // registers, each key vector loaded once for NT rows.
    for (int c0 = 0; c0 < KV; c0 += QK_V) {
      vf acc_s[NT][QK_V];
      for (int t = 0; t < NT; ++t)
        for (int c = 0; c < QK_V; ++c) acc_s[t][c] = vf{};
      for (int64_t d = 0; d < Dh; ++d) {
        vf kd[QK_V];
        for (int c = 0; c < QK_V; ++c) kd[c] = vload(kt + d * TK + (c0 + c) * W);
        for (int t = 0; t < NT; ++t) {
          const vf qd = splat(qr[t * Dh + d]);
          for (int c = 0; c < QK_V; ++c) acc_s[t][c] += qd * kd[c];
        }
      }
      for (int t = 0; t < NT; ++t)
        for (int c = 0; c < QK_V; ++c) vstore(p + t * TK + (c0 + c) * W, acc_s[t][c]);
    }
    // Every key of the tile visible to every row (most tiles of a long prefill: all keys
    // before the block's first row, inside every row's window): no masks to build or apply.
    // (Padding rows, at position -1, never are.)
    bool full = dense;
    for (int t = 0; t < NT && full; ++t) full = pos[r0 + t] >= smax && wlo[r0 + t] <= smin;
    // Online softmax per row, in place: scores -> probabilities (0 where masked).
    for (int t = 0; t < NT; ++t) {
      const int64_t r = r0 + t;
      vf sc[KV];
      vi ok[KV];
      vf vmax = neg_inf;
      if (full) {
        for (int c = 0; c < KV; ++c) {
          sc[c] = vload(p + t * TK + c * W);
          vmax = vmax > sc[c] ? vmax : sc[c];
        }
      } else {
        const vi rp = splati(pos[r]), rw = splati(wlo[r]);
        for (int c = 0; c < KV; ++c) {
          ok[c] = (spv[c] >= splati(0)) & (spv[c] <= rp) & (spv[c] >= rw);
          sc[c] = ok[c] ? vload(p + t * TK + c * W) : neg_inf;
          vmax = vmax > sc[c] ? vmax : sc[c];
        }
      }
      const float tmax = hmax(vmax);
      if (!(tmax > -std::numeric_limits<float>::infinity())) {  // nothing visible here
        std::memset(p + t * TK, 0, TK * sizeof(float));
        continue;
      }
      const float m_new = std::max(m[r], tmax);
      const vf mv = splat(m_new);
      vf sum = vf{};
      for (int c = 0; c < KV; ++c) {
        vf e = vexp(sc[c] - mv);
        if (!full) e = ok[c] ? e : vf{};
        sum += e;
        vstore(p + t * TK + c * W, e);
      }
      // 0 when m was -inf; 1 when the maximum stands (exp(0) is 1 exactly: no call)
      const float corr = m_new == m[r] ? 1.f : std::exp(m[r] - m_new);
      l[r] = l[r] * corr + hsum(sum);
      m[r] = m_new;
      if (corr != 1.f) {
        float* a = acc.data() + r * Dh;
        for (int n = 0; n < NV; ++n) vstore(a + n * W, vload(a + n * W) * splat(corr));
      }
    }
    // Probabilities times values: NT rows x NC head-dim vectors of accumulators a pass.
    constexpr int NC = PV_V == 0 || PV_V > NV ? NV : PV_V;
    static_assert(NV % NC == 0, "the value passes cover the head exactly");
    for (int n0 = 0; n0 < NV; n0 += NC) {
      vf o[NT][NC];
      for (int t = 0; t < NT; ++t)
        for (int n = 0; n < NC; ++n) o[t][n] = vload(acc.data() + (r0 + t) * Dh + (n0 + n) * W);
      for (int64_t j = 0; j < nk; ++j) {
        vf vj[NC];
        for (int n = 0; n < NC; ++n) vj[n] = vload(vp[j] + (n0 + n) * W);
        for (int t = 0; t < NT; ++t) {
          const vf pj = splat(p[t * TK + j]);
          for (int n = 0; n < NC; ++n) o[t][n] += pj * vj[n];
        }
      }
      for (int t = 0; t < NT; ++t)
        for (int n = 0; n < NC; ++n) vstore(acc.data() + (r0 + t) * Dh + (n0 + n) * W, o[t][n]);
    }
  };

  const int32_t* seg_rank = pb.rank + int64_t(seg) * (pb.MPp + 1);
  const int64_t r_lo = seg_rank[lo], r_hi = seg_rank[hi];
  for (int64_t chunk = c0; chunk < c1; ++chunk) {
    const int64_t rb = std::max(r_lo, chunk * CH), re = std::min(r_hi, (chunk + 1) * CH);
    std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());  // padding rows
    std::fill(l.begin(), l.end(), 0.f);                                      // see nothing
    std::fill(acc.begin(), acc.end(), 0.f);
    // The slot of visible index rb: its page by the rank table, then stepped to.
    int64_t pg = std::upper_bound(seg_rank + lo, seg_rank + hi, int32_t(rb)) - seg_rank - 1;
    int64_t off = 0, rank = seg_rank[pg];
    auto seen = [&](int64_t pg, int64_t off) {
      return view_index(seg_order, seg_vis, seg_len, ps, pg, off);
    };
    auto step = [&]() {
      if (++off == ps) {
        off = 0;
        ++pg;
      }
    };
    for (; rank < rb; step()) rank += seen(pg, off) >= 0;
    // A tile holds visible indices [t0, t0 + TK), key i in lane i - t0: a key's lane and
    // tile depend on the view alone, not on the unseen slots between keys (a node that ends
    // mid-page) nor on the block's first page (which a sliding window moves with the block).
    for (int64_t t0 = rb / TK * TK; t0 < re; t0 += TK) {
      nk = std::min<int64_t>(TK, re - t0);
      int n_keys = 0;
      smin = std::numeric_limits<int32_t>::max();
      smax = -1;
      for (int64_t j = 0; j < TK; ++j) {
        sp[j] = -1;
        kp[j] = vp[j] = zeros;
      }
      for (; rank < t0 + nk; step()) {
        const int64_t vs = seen(pg, off);
        if (vs < 0) continue;
        const int64_t j = rank++ - t0;
        if (vs > max_pos) continue;  // past the block's last row
        const int32_t s = int32_t(vs);
        sp[j] = s;
        ++n_keys;
        smin = std::min(smin, s);
        smax = std::max(smax, s);
        const int64_t slot = int64_t(seg_pages[pg]) * ps + off;
        kp[j] = pb.k + slot * stride + h * Dh;
        vp[j] = pb.v + slot * stride + h * Dh;
      }
      dense = n_keys == TK;
      if (n_keys == 0) continue;
      for (int c = 0; c < KV; ++c) spv[c] = viload(sp + c * W);
      // W x W blocks transposed in registers rather than element by element (fewer shuffles).
      for (int64_t j0 = 0; j0 < TK; j0 += W)
        for (int64_t d0 = 0; d0 < Dh; d0 += W) {
          vf blk[W];
          for (int i = 0; i < W; ++i) blk[i] = vload(kp[j0 + i] + d0);
          akv::transpose(blk);
          for (int i = 0; i < W; ++i) vstore(kt + (d0 + i) * TK + j0, blk[i]);
        }
      switch (R) {  // one token's query heads (a decode step): a tile of just its rows
        case 1: row_tile(std::integral_constant<int, 1>{}, 0); continue;
        case 2: row_tile(std::integral_constant<int, 2>{}, 0); continue;
        case 3: row_tile(std::integral_constant<int, 3>{}, 0); continue;
        case 4: row_tile(std::integral_constant<int, 4>{}, 0); continue;
        default: break;
      }
      for (int64_t r0 = 0; r0 < R; r0 += RT)
        row_tile(std::integral_constant<int, RT>{}, r0);
    }
    if (partial) {
      for (int64_t r = 0; r < R; ++r) {
        float* out = partial + r * (Dh + 2);
        out[0] = m[r];
        out[1] = l[r];
        std::copy(acc.data() + r * Dh, acc.data() + (r + 1) * Dh, out + 2);
      }
      return;
    }
    for (int64_t r = 0; r < R; ++r)
      fold(Dh, &run_m[r], &run_l[r], run_acc.data() + r * Dh, m[r], l[r], acc.data() + r * Dh);
  }
  finish(pb, b, h, run_l.data(), run_acc.data());
}

using ItemFn = void (*)(const Problem&, int64_t, int64_t, int64_t, int64_t, float*);

template <int NV>
ItemFn pick(int64_t nv) {
  if constexpr (NV > 256 / W) {
    return nullptr;
  } else {
    return nv == NV ? &attend<NV> : pick<NV + 16 / W>(nv);  // head_dim in 16s
  }
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages,
                ffi::Buffer<ffi::F32> v_pages, ffi::Buffer<ffi::S32> layer,
                ffi::Buffer<ffi::S32> pages, ffi::Buffer<ffi::S32> order,
                ffi::Buffer<ffi::PRED> kv_visible, ffi::Buffer<ffi::S32> kv_len,
                ffi::Buffer<ffi::S32> blk, ffi::Buffer<ffi::S32> win,
                ffi::Buffer<ffi::F32> sinks, ffi::ResultBuffer<ffi::F32> out, float sm_scale,
                int64_t has_window, int64_t has_sinks) {
  const auto qd = q.dimensions();
  const auto kd = k_pages.dimensions();
  if (qd.size() != 3 || kd.size() != 5)
    return ffi::Error::InvalidArgument("akv_cpu_attention: q [T,Hq,Dh], pools [L,P,ps,Hkv,Dh]");
  Problem pb;
  pb.T = qd[0];
  pb.Hq = qd[1];
  pb.Dh = qd[2];
  pb.ps = kd[2];
  pb.Hkv = kd[3];
  pb.G = pb.Hq / pb.Hkv;
  pb.MPp = pages.dimensions()[1];
  pb.block_q = win.dimensions()[1];
  pb.sm_scale = sm_scale;
  const int64_t L = kd[0], P = kd[1];
  const int64_t li = layer.typed_data()[0];
  if (li < 0 || li >= L) return ffi::Error::InvalidArgument("akv_cpu_attention: layer");
  if (pb.Dh % 16 || pb.Dh > 256 || kd[4] != pb.Dh || pb.Hq % pb.Hkv)
    return ffi::Error::InvalidArgument("akv_cpu_attention: head_dim must be 16..256, x16");
  const int64_t layer_size = P * pb.ps * pb.Hkv * pb.Dh;
  pb.q = q.typed_data();
  pb.k = k_pages.typed_data() + li * layer_size;
  pb.v = v_pages.typed_data() + li * layer_size;
  pb.pages = pages.typed_data();
  pb.order = order.typed_data();
  pb.kv_vis = kv_visible.typed_data();
  pb.kv_len = kv_len.typed_data();
  pb.N = kv_visible.dimensions()[1];
  if (order.dimensions()[1] != pb.MPp || pb.N < pb.MPp * pb.ps)
    return ffi::Error::InvalidArgument("akv_cpu_attention: order [S,MP], kv_visible [S,MP*ps]");
  pb.blk = blk.typed_data();
  pb.win = has_window ? win.typed_data() : nullptr;
  pb.sinks = has_sinks ? sinks.typed_data() : nullptr;
  pb.out = out->typed_data();
  std::memset(pb.out, 0, sizeof(float) * pb.T * pb.Hq * pb.Dh);  // rows no block covers
  const ItemFn fn = pick<16 / W>(pb.Dh / W);
  const int64_t NB = blk.dimensions()[0], n_items = NB * pb.Hkv;
  // Visible slots before each compacted page of each segment, up to the last page a block
  // of that segment reads (later entries are padding, never read).
  const int64_t S = pages.dimensions()[0];
  std::vector<int32_t> seg_hi(S, 0), rank(S * (pb.MPp + 1), 0);
  for (int64_t b = 0; b < NB; ++b) {
    const int32_t* bk = pb.blk + b * BLK_FIELDS;
    if (bk[0] >= 0 && bk[0] < S) seg_hi[bk[0]] = std::max(seg_hi[bk[0]], bk[5]);
  }
  for (int64_t sg = 0; sg < S; ++sg) {
    const int32_t* order_s = pb.order + sg * pb.MPp;
    const bool* vis_s = pb.kv_vis + sg * pb.N;
    int32_t* rank_s = rank.data() + sg * (pb.MPp + 1);
    for (int64_t pg = 0; pg < pb.MPp; ++pg) {
      int32_t n = 0;
      for (int64_t off = 0; pg < seg_hi[sg] && off < pb.ps; ++off)
        n += view_index(order_s, vis_s, pb.kv_len[sg], pb.ps, pg, off) >= 0;
      rank_s[pg + 1] = rank_s[pg] + n;
    }
  }
  pb.rank = rank.data();
  // Items that read keys: fewer than the threads (one long decode step), and each
  // chunk of a block's keys becomes an item of its own, folded in order afterwards.
  int64_t n_chunks = 0, real = 0;
  for (int64_t b = 0; b < NB; ++b) {
    int64_t c0, c1;
    chunk_range(pb, b, &c0, &c1);
    if (pb.blk[b * BLK_FIELDS] >= 0 && pb.blk[b * BLK_FIELDS + 2] > 0) {
      ++real;
      n_chunks += c1 - c0;
    }
  }
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  if (real * pb.Hkv >= threads || n_chunks <= real) {
    akv::parallel_for(pool, n_items, [&pb, fn, n_items](int64_t it) {
      // Largest first: later blocks of a causal prefill see the most keys.
      const int64_t b = (n_items - 1 - it) / pb.Hkv, h = (n_items - 1 - it) % pb.Hkv;
      int64_t c0, c1;
      chunk_range(pb, b, &c0, &c1);
      fn(pb, b, h, c0, c1, nullptr);
    });
    return ffi::Error::Success();
  }
  // (block, chunk, kv head) items; a chunk's kv heads run next to each other.
  std::vector<int64_t> item_b, item_c, first;  // first[b]: block b's first item
  for (int64_t b = 0; b < NB; ++b) {
    int64_t c0, c1;
    chunk_range(pb, b, &c0, &c1);
    first.push_back(int64_t(item_b.size()));
    if (pb.blk[b * BLK_FIELDS] < 0 || pb.blk[b * BLK_FIELDS + 2] <= 0) continue;
    for (int64_t c = c0; c < c1; ++c) {
      item_b.push_back(b);
      item_c.push_back(c);
    }
  }
  const int64_t stride = partial_rows(pb) * (pb.Dh + 2);
  std::vector<float> partials(item_b.size() * pb.Hkv * stride);
  akv::parallel_for(pool, int64_t(item_b.size()), [&](int64_t i) {
    for (int64_t h = 0; h < pb.Hkv; ++h)
      fn(pb, item_b[i], h, item_c[i], item_c[i] + 1, partials.data() + (i * pb.Hkv + h) * stride);
  });
  std::vector<float> run_acc, run_m, run_l;
  for (int64_t b = 0; b < NB; ++b) {
    const int32_t* bk = pb.blk + b * BLK_FIELDS;
    if (bk[0] < 0 || bk[2] <= 0) continue;
    const int64_t R = int64_t(bk[2]) * pb.G;
    int64_t c0, c1;
    chunk_range(pb, b, &c0, &c1);
    for (int64_t h = 0; h < pb.Hkv; ++h) {
      run_acc.assign(R * pb.Dh, 0.f);
      run_m.resize(R);
      run_l.resize(R);
      for (int64_t r = 0; r < R; ++r) start_row(pb, h * pb.G + r % pb.G, &run_m[r], &run_l[r]);
      for (int64_t c = c0; c < c1; ++c) {
        const float* part = partials.data() + ((first[b] + c - c0) * pb.Hkv + h) * stride;
        for (int64_t r = 0; r < R; ++r) {
          const float* pr = part + r * (pb.Dh + 2);
          fold(pb.Dh, &run_m[r], &run_l[r], run_acc.data() + r * pb.Dh, pr[0], pr[1], pr + 2);
        }
      }
      finish(pb, b, h, run_l.data(), run_acc.data());
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AkvCpuAttention, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_pages
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer [1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // order
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // kv_visible
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_len
                                  .Arg<ffi::Buffer<ffi::S32>>()  // blk
                                  .Arg<ffi::Buffer<ffi::S32>>()  // win
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("has_window")
                                  .Attr<int64_t>("has_sinks"));
