// Matrix products with many rows for XLA:CPU: y[M, N] = x[M, K] @ w[K, N], float32 (prefill
// and restore steps' projections), the CPU kernel of akv_jax.kernels.cpu.matmul.
//
// A blocked GEMM. w is packed into panels of NR = NB vectors of columns (64 with AVX-512,
// 16 with AVX2; [K][NR], contiguous, zero-padded past N: read in place, a panel's rows are N
// floats apart and fall into a few L1 sets), at most PACK_BYTES of them at a time. Items
// are (MC-row chunk of x) x (range of panels); for each panel and each slice of k, an item
// runs the register kernel over its rows MR at a time: MR x NB vector accumulators, a panel
// row of w in NB vectors, one broadcast of x per row, x read in place (MR sequential
// streams; a last, short micro-panel from a zero-padded copy). The panel's slice of w stays
// in cache across the chunk's micro-panels (L1 with AVX2; with AVX-512 a 192-deep slice of
// 64 columns, 48 KB, may pass L1, yet the 6 x 4 tile measured faster); it is prefetched in
// software, and the next slice into L2 (the hardware prefetchers alone fell well short).
//
// AkvCpuGemmPacked is the same product from w packed ahead of time in that layout (a stack
// of layers, matmul.pack_panels): it reads the layer's panels where they lie.
// AkvCpuGemmGated and AkvCpuGemmPackedEpilogue finish each block of y as it lands: SwiGLU's
// silu(gate) * (x @ w) (vec.h's epilogue) or, from packed w, also x @ w + r (a residual
// stream), where XLA made a pass over y of its own.
//
// Every output element is the same sum in the same order as in matmul.cc's few-row
// kernel (a chain of fused multiply-adds per slice of k, slices added in order): a row's
// result does not depend on how many rows the call has or where the row sits.

#include <algorithm>
#include <cstdint>
#include <cstring>
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

// MR x NB accumulators, NB panel vectors and a broadcast in the CPU's vector registers.
// AVX-512: 6 x 4 (24 + 4 + 1 of 32: each k step's 4 loads and 6 broadcasts feed 24
// multiply-adds) rather than 14 x 2 (28 + 2 + 1; 16 loads and broadcasts for 28); figures
// in docs/cpu-kernels.md.
#ifdef __AVX512F__
constexpr int NB = 4;
constexpr int MR = 6;
#else
constexpr int NB = 2;
constexpr int MR = 6;   // 12 + 2 + 1 of AVX2's 16
#endif
constexpr int NR = NB * W;    // columns per panel
constexpr int PD = 8;  // k steps of software prefetch ahead in the panel's stream
constexpr int64_t MC = 12 * MR;  // rows of x per item
// Packed w at a time (the calling thread's buffer): a vocabulary head of a training
// forward would otherwise copy the whole embedding.
constexpr int64_t PACK_BYTES = 16 << 20;

// What the GEMM does to each block of y as it lands (the packed entries' `epilogue`).
enum class Epilogue : int64_t { kNone = 0, kSiluMul = 1, kAdd = 2 };

// y[i] += e[i] for i < n.
inline void add_inplace(float* y, const float* e, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) vstore(y + i, vload(y + i) + vload(e + i));
  for (; i < n; ++i) y[i] += e[i];
}


// One micro-panel of x (row m, step k at ap[k * sk + m * sm]: in place, or a packed copy)
// times one panel slice of w (bp: [kc][NR]) into the MR x NR block at c (row stride ldc).
// `first`: the slice starts at k = 0 (it writes c; later slices add to it).
// `next`: the next panel slice of w, to prefetch into L2 (a slice is read from memory once
// per item and then reused from L1 by every micro-panel; without the prefetch the first
// micro-panel waits on it line by line).
// R < MR: a last micro-panel of R rows with R rows of registers (padded to MR rows, the 2
// rows left of a 128-row call ran as 14: SmolLM2's 128-row forward took ~10% longer).
template <bool PREFETCH, int R = MR>
inline void micro_full(const float* ap, int64_t sk, int64_t sm, const float* bp, int64_t kc,
                       float* c, int64_t ldc, bool first, const float* next) {
  vf acc[R][NB];
  for (int m = 0; m < R; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = vf{};
  for (int64_t k = 0; k < kc; ++k) {
    if constexpr (PREFETCH) {
      for (int n = 0; n < NB; ++n) __builtin_prefetch(next + k * NR + n * W, 0, 2);
    }
    for (int n = 0; n < NB; ++n) __builtin_prefetch(bp + (k + PD) * NR + n * W);
    vf b[NB];
    for (int n = 0; n < NB; ++n) b[n] = vload(bp + k * NR + n * W);
    const float* a = ap + k * sk;
    for (int m = 0; m < R; ++m) {
      const vf am = splat(a[m * sm]);
      for (int n = 0; n < NB; ++n) acc[m][n] += am * b[n];
    }
  }
  for (int m = 0; m < R; ++m)
    for (int n = 0; n < NB; ++n)
      vstore(c + m * ldc + n * W, first ? acc[m][n] : vload(c + m * ldc + n * W) + acc[m][n]);
}

template <int R>
void micro_rows(const float* ap, int64_t sk, int64_t sm, const float* bp, int64_t kc, float* c,
                int64_t ldc, int rows, bool first) {
  if constexpr (R > 0) {
    if (rows == R) return micro_full<false, R>(ap, sk, sm, bp, kc, c, ldc, first, nullptr);
    return micro_rows<R - 1>(ap, sk, sm, bp, kc, c, ldc, rows, first);
  }
}

// The same for a block cut short by the last rows (full columns: R rows of registers) or
// columns (through a full-size copy).
void micro(const float* ap, int64_t sk, int64_t sm, const float* bp, int64_t kc, float* c,
           int64_t ldc, int rows, int cols, bool first, const float* next) {
  if (rows == MR && cols == NR) {
    if (next) return micro_full<true>(ap, sk, sm, bp, kc, c, ldc, first, next);
    return micro_full<false>(ap, sk, sm, bp, kc, c, ldc, first, nullptr);
  }
  if (cols == NR) return micro_rows<MR - 1>(ap, sk, sm, bp, kc, c, ldc, rows, first);
  alignas(64) float block[MR * NR] = {};
  if (!first)
    for (int m = 0; m < rows; ++m) std::memcpy(block + m * NR, c + m * ldc, sizeof(float) * cols);
  micro_full<false>(ap, sk, sm, bp, kc, block, NR, first, nullptr);
  for (int m = 0; m < rows; ++m) std::memcpy(c + m * ldc, block + m * NR, sizeof(float) * cols);
}

struct Gemm {
  const float* x;
  const float* w;
  float* y;
  int64_t M, K, N;
  int64_t panels, kc;
  int64_t pack0;             // first panel in packed_w
  const float* packed_w;     // [panels packed][K][NR]
  float* pack_buf = nullptr;  // where pack_w writes them (packed_w), when it does
  // The epilogue's operand e [M, N], or null, applied to each MR x NR block as its last
  // slice of k lands (still in L1) instead of in an XLA pass over [M, N]: SwiGLU's gate
  // (y = silu(e) * (x @ w)) or a residual stream (y = x @ w + e, the add's bits as XLA's).
  const float* e = nullptr;
  Epilogue epilogue = Epilogue::kNone;

  void pack_w(int64_t p) const {
    float* dst = pack_buf + (p - pack0) * K * NR;
    const int64_t c0 = p * NR, cols = std::min<int64_t>(NR, N - c0);
    for (int64_t k = 0; k < K; ++k) {
      std::memcpy(dst + k * NR, w + k * N + c0, sizeof(float) * cols);
      if (cols < NR) std::memset(dst + k * NR + cols, 0, sizeof(float) * (NR - cols));
    }
  }

  // Rows [m0, m0 + rows) of x, k in [k0, k0 + kcur): micro-panels [kcur][MR], zero rows past
  // the end.
  void pack_x(float* dst, int64_t m0, int64_t rows, int64_t k0, int64_t kcur) const {
    for (int64_t i = 0; i < rows; i += MR) {
      float* panel = dst + (i / MR) * kcur * MR;
      const int64_t r = std::min<int64_t>(MR, rows - i);
      const float* src[MR];
      for (int64_t m = 0; m < MR; ++m) src[m] = x + (m0 + i + std::min(m, r - 1)) * K + k0;
      // k outer, rows inner: contiguous stores, MR sequential read streams.
      for (int64_t k = 0; k < kcur; ++k)
        for (int64_t m = 0; m < MR; ++m) panel[k * MR + m] = m < r ? src[m][k] : 0.f;
    }
  }

  // Rows [m0, m0 + n) of e's columns [c0, c0 + cols) into L1 (n <= 0: none).
  void prefetch_e(int64_t m0, int64_t n, int64_t c0, int cols) const {
    for (int64_t m = 0; m < n; ++m)
      for (int j = 0; j < cols; j += 64 / sizeof(float))
        __builtin_prefetch(e + (m0 + m) * N + c0 + j);
  }

  // Panels outer, slices of k inner: the chunk's C block of one panel (MC x NR, 21 KB with
  // AVX-512) stays in cache across the slices that add into it, where slices outer re-read
  // the chunk's whole C row block per slice (same bits: each output's slices add in order).
  void item(int64_t m0, int64_t rows, int64_t p0, int64_t p1) const {
    thread_local std::vector<float> xbuf;
    const int64_t micro_panels = (rows + MR - 1) / MR;
    const int64_t full = rows / MR;  // whole micro-panels read x in place (MR row streams)
    if (full < micro_panels) {       // a last, short one: a zero-padded copy of all of k
      xbuf.resize(MR * K);
      pack_x(xbuf.data(), m0 + full * MR, rows - full * MR, 0, K);
    }
    for (int64_t p = p0; p < p1; ++p) {
      const int cols = static_cast<int>(std::min<int64_t>(NR, N - p * NR));
      for (int64_t k0 = 0; k0 < K; k0 += kc) {
        const int64_t kcur = std::min(kc, K - k0);
        const float* bp = packed_w + (p - pack0) * K * NR + k0 * NR;
        // The slice of w that comes next: this panel's next slice, else the next panel's
        // first (the packed panels are contiguous, each all of k).
        const float* next = k0 + kc < K || p + 1 < p1 ? bp + kcur * NR : nullptr;
        for (int64_t i = 0; i < micro_panels; ++i) {
          const int r = static_cast<int>(std::min<int64_t>(MR, rows - i * MR));
          float* c = y + (m0 + i * MR) * N + p * NR;
          const float* pf = i == 0 ? next : nullptr;
          // The epilogue's rows of e, a micro-panel ahead: they come from memory.
          if (e && k0 + kcur == K)
            for (int64_t j = i == 0 ? 0 : 1; j < 2; ++j)
              prefetch_e(m0 + (i + j) * MR, std::min<int64_t>(MR, rows - (i + j) * MR), p * NR,
                         cols);
          if (r == MR)
            micro(x + (m0 + i * MR) * K + k0, 1, K, bp, kcur, c, N, r, cols, k0 == 0, pf);
          else
            micro(xbuf.data() + k0 * MR, MR, 1, bp, kcur, c, N, r, cols, k0 == 0, pf);
          if (e && k0 + kcur == K)
            for (int m = 0; m < r; ++m) {
              const float* em = e + (m0 + i * MR + m) * N + p * NR;
              if (epilogue == Epilogue::kSiluMul) akv::silu_mul_inplace(c + m * N, em, cols);
              else add_inplace(c + m * N, em, cols);
            }
        }
      }
    }
  }
};

// Runs g over its rows 0..g.M (g.M > 0, g.K > 0, g.N > 0). `pack`: pack w into
// g.pack_buf (= g.packed_w), PACK_BYTES at a time; else g.packed_w holds every panel.
void run(ffi::ThreadPool& pool, Gemm& g, bool pack) {
  const int64_t per_pack =
      pack ? std::max<int64_t>(1, PACK_BYTES / (g.K * NR * sizeof(float))) : g.panels;
  const int64_t chunks = (g.M + MC - 1) / MC;
  for (int64_t b0 = 0; b0 < g.panels; b0 += per_pack) {
    const int64_t b1 = std::min(g.panels, b0 + per_pack), nb = b1 - b0;
    if (pack) {
      g.pack0 = b0;
      akv::parallel_for(pool, nb, [&g, b0](int64_t p) { g.pack_w(b0 + p); });
    }
    // Items: chunks of MC rows, and each chunk's panels split so that there are at least
    // three items a thread where the rows alone do not give that many.
    const int64_t want = 3 * (pool.num_threads() + 1);
    const int64_t splits = std::min(nb, std::max<int64_t>(1, (want + chunks - 1) / chunks));
    akv::parallel_for(pool, chunks * splits, [&g, splits, b0, nb](int64_t it) {
      const int64_t chunk = it / splits, s = it % splits;
      const int64_t m0 = chunk * MC;
      g.item(m0, std::min(MC, g.M - m0), b0 + nb * s / splits, b0 + nb * (s + 1) / splits);
    });
  }
}

// Rows from `live` on are zero in y (e + 0 with the add epilogue, as XLA's x + zero rows);
// g.M is the rows before it. False: nothing left to do.
bool start(Gemm& g, int64_t rows, int32_t live) {
  g.M = std::clamp<int64_t>(live, 0, rows);
  const int64_t first_zero = g.K == 0 ? 0 : g.M;  // no k: every row's product is zero
  std::memset(g.y + first_zero * g.N, 0, sizeof(float) * (rows - first_zero) * g.N);
  if (g.epilogue == Epilogue::kAdd)
    add_inplace(g.y + first_zero * g.N, g.e + first_zero * g.N, (rows - first_zero) * g.N);
  if (g.M == 0 || g.N == 0 || g.K == 0) return false;
  g.panels = (g.N + NR - 1) / NR;
  g.kc = akv::k_slice(g.K);  // the summation order both matmul kernels share
  return true;
}

// `live` [1]: rows of x past it are a step's padding (no query block reads them; the engine
// pads a prefill to its next bucket): y is zero there and they cost nothing. A 2,000-token
// prompt runs 2,048 rows, an agent turn's ~330 new tokens 384.
ffi::Error Plain(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::F32>& w,
                 const float* e, Epilogue epilogue, ffi::Buffer<ffi::S32>& live,
                 ffi::ResultBuffer<ffi::F32>& y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0] || live.element_count() != 1)
    return ffi::Error::InvalidArgument("akv_cpu_gemm: x [M, K] @ w [K, N], live rows [1]");
  Gemm g;
  g.x = x.typed_data();
  g.w = w.typed_data();
  g.y = y->typed_data();
  g.e = e;
  g.epilogue = epilogue;
  g.K = xd[1];
  g.N = wd[1];
  if (!start(g, xd[0], live.typed_data()[0])) return ffi::Error::Success();
  // The calling thread's buffer: XLA runs a computation's thunks on the same few threads,
  // so this is allocated once and reused.
  thread_local std::vector<float> wbuf;
  const int64_t per_pack = std::max<int64_t>(1, PACK_BYTES / (g.K * NR * sizeof(float)));
  wbuf.resize(std::min(per_pack, g.panels) * g.K * NR);
  g.packed_w = g.pack_buf = wbuf.data();
  run(pool, g, true);
  return ffi::Error::Success();
}

// The same product from w packed ahead of time (matmul.pack_panels: w [L, K, N] as
// [L, panels, K, NR], zero past N), layer `layer` of the stack: a prefill's layer scan
// hands the kernel the whole stack and the layer's index, so neither XLA (slicing the
// layer's weights out of the stack) nor the kernel (packing them) copies them per call.
ffi::Error Packed(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::F32>& wp,
                  ffi::Buffer<ffi::S32>& layer, const float* e, Epilogue epilogue,
                  ffi::Buffer<ffi::S32>& live, ffi::ResultBuffer<ffi::F32>& y) {
  const auto xd = x.dimensions();
  const auto pd = wp.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || pd.size() != 4 || yd.size() != 2 || yd[0] != xd[0] ||
      pd[2] != xd[1] || pd[3] != NR || pd[1] != (yd[1] + NR - 1) / NR ||
      layer.element_count() != 1 || live.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "akv_cpu_gemm_packed: x [M, K] @ panels [L, ceil(N / NR), K, NR] -> y [M, N], "
        "layer [1], live rows [1]");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= pd[0])
    return ffi::Error::InvalidArgument("akv_cpu_gemm_packed: layer outside the stack");
  Gemm g;
  g.x = x.typed_data();
  g.w = nullptr;
  g.y = y->typed_data();
  g.e = e;
  g.epilogue = epilogue;
  g.K = xd[1];
  g.N = yd[1];
  if (!start(g, xd[0], live.typed_data()[0])) return ffi::Error::Success();
  g.pack0 = 0;
  g.packed_w = wp.typed_data() + l * pd[1] * g.K * NR;
  run(pool, g, false);
  return ffi::Error::Success();
}

// The epilogue's operand must be y's shape.
bool fits(ffi::Buffer<ffi::F32>& e, ffi::ResultBuffer<ffi::F32>& y) {
  const auto ed = e.dimensions();
  const auto yd = y->dimensions();
  return ed.size() == 2 && yd.size() == 2 && ed[0] == yd[0] && ed[1] == yd[1];
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> y) {
  return Plain(pool, x, w, nullptr, Epilogue::kNone, live, y);
}

ffi::Error ImplPacked(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> wp,
                      ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> live,
                      ffi::ResultBuffer<ffi::F32> y) {
  return Packed(pool, x, wp, layer, nullptr, Epilogue::kNone, live, y);
}

// silu(gate) * (x @ w): SwiGLU's up projection with the activation as its epilogue.
ffi::Error ImplGated(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                     ffi::Buffer<ffi::F32> gate, ffi::Buffer<ffi::S32> live,
                     ffi::ResultBuffer<ffi::F32> y) {
  if (!fits(gate, y)) return ffi::Error::InvalidArgument("akv_cpu_gemm_gated: gate [M, N]");
  return Plain(pool, x, w, gate.typed_data(), Epilogue::kSiluMul, live, y);
}

// From packed w, with an epilogue (1: silu(e) * (x @ w), SwiGLU's gate; 2: x @ w + e, a
// residual stream).
ffi::Error ImplPackedEpilogue(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                              ffi::Buffer<ffi::F32> wp, ffi::Buffer<ffi::S32> layer,
                              ffi::Buffer<ffi::F32> e, ffi::Buffer<ffi::S32> live,
                              ffi::ResultBuffer<ffi::F32> y, int64_t epilogue) {
  if (!fits(e, y)) return ffi::Error::InvalidArgument("akv_cpu_gemm_packed_epilogue: e [M, N]");
  if (epilogue != int64_t(Epilogue::kSiluMul) && epilogue != int64_t(Epilogue::kAdd))
    return ffi::Error::InvalidArgument("akv_cpu_gemm_packed_epilogue: epilogue 1 or 2");
  return Packed(pool, x, wp, layer, e.typed_data(), Epilogue(epilogue), live, y);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AkvCpuGemm, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [K, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // live rows [1]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(AkvCpuGemmPacked, ImplPacked,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // panels [L, P, K, NR]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer [1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // live rows [1]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(AkvCpuGemmGated, ImplGated,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [K, N]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // gate [M, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // live rows [1]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(AkvCpuGemmPackedEpilogue, ImplPackedEpilogue,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // panels [L, P, K, NR]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer [1]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // e [M, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // live rows [1]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<int64_t>("epilogue"));

// The panel width NR the packed layout must have (matmul.panel_width).
extern "C" int AkvCpuGemmPanelWidth() { return NR; }
