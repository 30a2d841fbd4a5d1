// What the XLA:CPU kernels (cpu_*.cc) share besides their work sharing (cpu_pool.h): the
// vector type and its loads, and the order in which the matmul kernels sum.

#pragma once

#include <cstdint>
#include <cstring>

namespace akv {

// GCC vector extensions, 16 floats: AVX-512 with -march=native where the CPU has it, pairs
// of AVX2 registers otherwise.
constexpr int W = 16;
typedef float vf __attribute__((vector_size(W * sizeof(float))));

inline vf vload(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
// Lane by lane, not ``vf{} + x``: 0 + x is not x for x = -0, so that form costs an add
// before every broadcast in the inner loops.
inline vf splat(float x) { return vf{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

// k per slice for a product of depth K in cpu_matmul.cc and cpu_gemm.cc: equal slices of at
// most 256, each summed from zero as one chain of fused multiply-adds, then added to the
// output in order. One chain over all of K rounds like a sum of K terms (SmolLM2's
// 1,536-deep down projection: twice XLA's error, max |err| 2.7e-4 against float64 on random
// normals), slices of 256 like one of ~256 + K / 256 (8.2e-5; XLA, which cuts K at 512,
// 1.3e-4). Both kernels slicing alike is what makes a row's bits independent of the batch.
inline int64_t k_slice(int64_t K) {
  constexpr int64_t kMax = 256;
  const int64_t slices = (K + kMax - 1) / kMax;
  return (K + slices - 1) / slices;
}

}  // namespace akv
