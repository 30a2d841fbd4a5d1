// Few-row matrix products for XLA:CPU: y[M, N] = x[M, K] @ w[K, N] for M <= 16 (decode steps),
// the CPU kernel of akv_jax.kernels.cpu.matmul.
//
// A decode step streams every weight once; with 1 row XLA runs a matrix-vector product at the
// memory's speed, but from 2 to 16 rows its small-GEMM path is compute-bound (figures:
// docs/cpu-kernels.md). Here w is read once, in bands of BAND whole rows
// (a thread's column range of each: BAND sequential streams), each row's 32-column pieces
// multiplied into register accumulators for up to 8 rows of x; partial sums live in a
// per-thread buffer between bands and in y between slices of k.
// Columns are split across XLA's intra-op threads. A second entry point takes w as [N, K]
// (a tied embedding used as the output head), whose rows are contiguous already; a third,
// SwiGLU's gate too, and returns silu(gate) * (x @ w) (vec.h's epilogue, as the GEMM's).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "pool.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int PIECE = 32;  // columns per piece handed to a thread (whole pieces each)
constexpr int MT = 8;   // rows of x per register tile (x 2 vectors of columns)
// Rows of w per band: a band's row segments, piece after piece, are sequential streams the
// memory serves faster than a piece's rows N floats apart (docs/cpu-kernels.md).
constexpr int BAND = 8;

using akv::splat;
using akv::vf;
using akv::vload;
using akv::vstore;
using akv::W;

// Columns [c0, c1) (multiples of 32 apart from the last piece) of rows [m0, m0 + MR).
// w is read in bands of BAND rows, each band's row segments [c0, c1) piece after piece, so
// the memory sees BAND sequential streams; each piece's accumulators carry on their chain of
// multiply-adds across the bands of a slice through a buffer (the same sums in the same
// order as one pass over the slice), then add into y at the slice's end.
template <int MR, int NC = 2>
void tile(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t m0,
          int64_t c0, int64_t c1) {
  const int64_t kb = akv::k_slice(K);
  const int64_t cv = c0 + (c1 - c0) / (NC * W) * (NC * W);  // end of the whole pieces
  thread_local std::vector<float> carry;
  carry.resize(MR * std::max<int64_t>(cv - c0, 1));
  for (int64_t k0 = 0; k0 < K; k0 += kb) {
    const int64_t k1 = std::min<int64_t>(K, k0 + kb);
    for (int64_t b0 = k0; b0 < k1; b0 += BAND) {
      const int64_t b1 = std::min<int64_t>(k1, b0 + BAND);
      for (int64_t c = c0; c < cv; c += NC * W) {
        float* cr = carry.data() + (c - c0) * MR;  // [MR][NC * W] for this piece
        vf acc[MR][NC];
        for (int m = 0; m < MR; ++m)
          for (int n = 0; n < NC; ++n) acc[m][n] = b0 == k0 ? vf{} : vload(cr + (m * NC + n) * W);
        for (int64_t k = b0; k < b1; ++k) {
          for (int n = 0; n < NC; ++n) __builtin_prefetch(w + (k + BAND) * N + c + n * W);
          vf wk[NC];
          for (int n = 0; n < NC; ++n) wk[n] = vload(w + k * N + c + n * W);
          for (int m = 0; m < MR; ++m) {
            const vf xm = splat(x[(m0 + m) * K + k]);
            for (int n = 0; n < NC; ++n) acc[m][n] += xm * wk[n];
          }
        }
        if (b1 < k1) {
          for (int m = 0; m < MR; ++m)
            for (int n = 0; n < NC; ++n) vstore(cr + (m * NC + n) * W, acc[m][n]);
          continue;
        }
        for (int m = 0; m < MR; ++m)
          for (int n = 0; n < NC; ++n) {
            float* dst = y + (m0 + m) * N + c + n * W;
            vstore(dst, k0 == 0 ? acc[m][n] : vload(dst) + acc[m][n]);
          }
      }
    }
    for (int64_t c = cv; c < c1; ++c) {  // a last piece narrower than 32 columns
      for (int m = 0; m < MR; ++m) {
        float a = 0.f;
        // std::fma: written as `a += x * w`, GCC vectorises the products and adds them in
        // order without fusing, and these columns would round unlike the vector ones (and
        // unlike gemm.cc's, whose rows match this kernel's bit for bit).
        for (int64_t k = k0; k < k1; ++k) a = std::fma(x[(m0 + m) * K + k], w[k * N + c], a);
        y[(m0 + m) * N + c] = k0 == 0 ? a : y[(m0 + m) * N + c] + a;
      }
    }
  }
}

// y[m, n] = dot(x[m], w[n]) for w [N, K] (a tied embedding as the output head): each row of
// w is contiguous, read once, for MR rows of x.
template <int MR>
void tile_nt(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t m0,
             int64_t c0, int64_t c1) {
  for (int64_t n = c0; n < c1; ++n) {
    const float* wn = w + n * K;
    vf acc[MR];
    for (int m = 0; m < MR; ++m) acc[m] = vf{};
    int64_t k = 0;
    for (; k + W <= K; k += W) {
      // 5-8 rows: the row 8 ahead, prefetched; at 4 rows the hardware's own prefetch keeps up
      // with the lighter arithmetic and ours cost more than they hide.
      if constexpr (MR > 4) __builtin_prefetch(wn + 8 * K + k);
      const vf wv = vload(wn + k);
      for (int m = 0; m < MR; ++m) acc[m] += vload(x + (m0 + m) * K + k) * wv;
    }
    for (int m = 0; m < MR; ++m) {
      float a = 0.f;
      for (int64_t kk = k; kk < K; ++kk) a += x[(m0 + m) * K + kk] * wn[kk];
      for (int step = W / 2; step >= 1; step /= 2)
        for (int i = 0; i < step; ++i) acc[m][i] += acc[m][i + step];
      y[(m0 + m) * N + n] = acc[m][0] + a;
    }
  }
}

using TileFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t,
                        int64_t);
constexpr TileFn kTiles[MT + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>,
                                   tile<5>, tile<6>, tile<7>, tile<8>};
constexpr TileFn kTilesNT[MT + 1] = {nullptr,    tile_nt<1>, tile_nt<2>, tile_nt<3>, tile_nt<4>,
                                     tile_nt<5>, tile_nt<6>, tile_nt<7>, tile_nt<8>};

// `gate` [M, N] or null: y = silu(gate) * (x @ w), each thread's columns as it finishes them.
ffi::Error Run(ffi::ThreadPool& pool, const float* x, const float* w, float* y, int64_t M,
               int64_t K, int64_t N, const TileFn* tiles, const float* gate = nullptr) {
  if (K == 0) {
    std::memset(y, 0, sizeof(float) * M * N);
    return ffi::Error::Success();
  }
  // Column ranges in whole 32-column pieces, one a thread; the last takes the remainder.
  const int64_t pieces = (N + PIECE - 1) / PIECE;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), pieces));
  akv::parallel_for(pool, parts, [=](int64_t part) {
    const int64_t c0 = std::min(N, pieces * part / parts * PIECE);
    const int64_t c1 = part + 1 == parts ? N : std::min(N, pieces * (part + 1) / parts * PIECE);
    for (int64_t m0 = 0; m0 < M; m0 += MT)
      tiles[std::min<int64_t>(MT, M - m0)](x, w, y, K, N, m0, c0, c1);
    if (gate)
      for (int64_t m = 0; m < M; ++m)
        akv::silu_mul_inplace(y + m * N + c0, gate + m * N + c0, c1 - c0);
  });
  return ffi::Error::Success();
}

// x [M, K] @ w [K, N]
ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0])
    return ffi::Error::InvalidArgument("akv_cpu_matmul: x [M, K] @ w [K, N]");
  return Run(pool, x.typed_data(), w.typed_data(), y->typed_data(), xd[0], xd[1], wd[1], kTiles);
}

// silu(gate) * (x @ w): SwiGLU's up projection with the activation as its epilogue
ffi::Error ImplGated(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                     ffi::Buffer<ffi::F32> gate, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto gd = gate.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0] || gd.size() != 2 ||
      gd[0] != xd[0] || gd[1] != wd[1])
    return ffi::Error::InvalidArgument("akv_cpu_matmul_gated: x [M, K] @ w [K, N], gate [M, N]");
  return Run(pool, x.typed_data(), w.typed_data(), y->typed_data(), xd[0], xd[1], wd[1], kTiles,
             gate.typed_data());
}

// x [M, K] @ w [N, K]^T
ffi::Error ImplNT(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                  ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("akv_cpu_matmul_nt: x [M, K] @ w [N, K]^T");
  return Run(pool, x.typed_data(), w.typed_data(), y->typed_data(), xd[0], xd[1], wd[0],
             kTilesNT);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AkvCpuMatmul, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [K, N]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(AkvCpuMatmulGated, ImplGated,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [K, N]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // gate [M, N]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(AkvCpuMatmulNT, ImplNT,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [N, K]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]
