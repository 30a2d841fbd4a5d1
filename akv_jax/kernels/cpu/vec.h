// What the XLA:CPU kernels (*.cc) share besides their work sharing (pool.h): the
// vector type and its loads, the order in which the matmul kernels sum, the exponential, and
// the gated products' epilogue.

#pragma once

#include <cstdint>
#include <cstring>
#include <utility>

namespace akv {

// GCC vector extensions of the CPU's own register width (-march=native): 16 floats with
// AVX-512, 8 with AVX2. A 16-float type on an AVX2 CPU is not a pair of registers to GCC
// but a memory object: the GEMM's accumulators would live on the stack, shuffled through
// general registers every step.
#ifdef __AVX512F__
constexpr int W = 16;
#else
constexpr int W = 8;
#endif
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));

inline vf vload(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vi viload(const int32_t* p) { vi v; std::memcpy(&v, p, sizeof v); return v; }

// Lane by lane, not ``vf{} + x``: 0 + x is not x for x = -0, so that form costs an add
// before every broadcast in the inner loops.
template <typename V, typename T, std::size_t... I>
inline V splat_lanes(T x, std::index_sequence<I...>) { return V{((void)I, x)...}; }
inline vf splat(float x) { return splat_lanes<vf>(x, std::make_index_sequence<W>{}); }
inline vi splati(int32_t x) { return splat_lanes<vi>(x, std::make_index_sequence<W>{}); }

// v with lane i swapped for lane i ^ STEP (STEP a power of two below W): the steps of a
// horizontal reduction as a tree of shuffles, not a W-long scalar chain.
template <int STEP, std::size_t... I>
inline vf xor_lanes(vf v, std::index_sequence<I...>) {
  return __builtin_shuffle(v, vi{static_cast<int32_t>(I ^ STEP)...});
}
template <int STEP = W / 2>
inline float hsum(vf v) {
  v += xor_lanes<STEP>(v, std::make_index_sequence<W>{});
  if constexpr (STEP > 1) return hsum<STEP / 2>(v);
  else return v[0];
}
template <int STEP = W / 2>
inline float hmax(vf v) {
  const vf o = xor_lanes<STEP>(v, std::make_index_sequence<W>{});
  v = v > o ? v : o;
  if constexpr (STEP > 1) return hmax<STEP / 2>(v);
  else return v[0];
}

// Transposes W rows of W lanes in registers: afterwards r[i][l] is what r[l][i] was. log2(W)
// stages; the stage of step H swaps, between rows i and i + H (bit H of i clear), the lanes
// with bit H set in row i and those with it clear in row i + H, two two-source shuffles a
// pair (vpermt2ps with AVX-512).
template <int H, std::size_t... I>
inline void swap_blocks(vf& a, vf& b, std::index_sequence<I...>) {
  const vf lo = __builtin_shuffle(a, b, vi{static_cast<int32_t>((I & H) ? W + I - H : I)...});
  const vf hi = __builtin_shuffle(a, b, vi{static_cast<int32_t>((I & H) ? W + I : I + H)...});
  a = lo;
  b = hi;
}
template <int H = W / 2>
inline void transpose(vf (&r)[W]) {
  for (int i = 0; i < W; ++i)
    if ((i & H) == 0) swap_blocks<H>(r[i], r[i + H], std::make_index_sequence<W>{});
  if constexpr (H > 1) transpose<H / 2>(r);
}

// k per slice for a product of depth K in matmul.cc and gemm.cc: equal slices of at
// most 256, each summed from zero as one chain of fused multiply-adds, then added to the
// output in order. One chain over all of K rounds like a sum of K terms, slices of 256 like
// one of ~256 + K / 256 (more accurate than XLA's slices of 512: docs/cpu-kernels.md). Both
// kernels slicing alike is what makes a row's bits independent of the batch (whatever the
// vector width: each output is its own chain).
inline int64_t k_slice(int64_t K) {
  constexpr int64_t kMax = 256;
  const int64_t slices = (K + kMax - 1) / kMax;
  return (K + slices - 1) / slices;
}

// e^x, Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for e^r, 2^n built
// in the exponent bits, for x <= 88 (callers clamp above: past it 2^n is not a float). Below
// -87 it returns ~e^-87 (where 2^n would leave the normal floats): the attention's softmax
// (scores minus their running maximum, <= 0) zeroes its masked lanes itself.
inline vf vexp(vf x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  vf n = (x * splat(1.44269504088896341f) + magic) - magic;
  vf r = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
  vf y = splat(1.9875691500e-4f);
  y = y * r + splat(1.3981999507e-3f);
  y = y * r + splat(8.3334519073e-3f);
  y = y * r + splat(4.1665795894e-2f);
  y = y * r + splat(1.6666665459e-1f);
  y = y * r + splat(5.0000001201e-1f);
  y = y * r * r + r + splat(1.0f);
  vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf pow2;
  std::memcpy(&pow2, &e, sizeof pow2);
  return y * pow2;
}

// SwiGLU's activation times the up projection, silu(g) * u = g / (1 + e^-g) * u, lane by
// lane: the epilogue of the gated products in matmul.cc and gemm.cc, which share it
// so that an MLP row's bits do not depend on which kernel ran (as their sums do not). e^-g
// on -g clamped to [-87, 88] (vexp's range): past it silu(g) is g (g > 87, e^-g < 1.7e-38
// beside 1) or 0 (g < -88: |silu(g)| < 1e-36).
inline vf vsilu_mul(vf g, vf u) {
  vf x = -g;
  x = x > splat(88.0f) ? splat(88.0f) : x;
  return g / (splat(1.0f) + vexp(x)) * u;
}

// y[i] = silu(g[i]) * y[i] for i < n, every element through vsilu_mul (a last part vector
// through a zero-padded copy: an element's bits do not depend on where it lies).
inline void silu_mul_inplace(float* y, const float* g, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) vstore(y + i, vsilu_mul(vload(g + i), vload(y + i)));
  if (i < n) {
    alignas(64) float gt[W] = {}, yt[W] = {};
    std::memcpy(gt, g + i, sizeof(float) * (n - i));
    std::memcpy(yt, y + i, sizeof(float) * (n - i));
    vstore(yt, vsilu_mul(vload(gt), vload(yt)));
    std::memcpy(y + i, yt, sizeof(float) * (n - i));
  }
}

}  // namespace akv
