// Vector helpers shared by the kernels: one register of floats, a vectorized exp, horizontal reductions, argument
// checks.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace raylm {

// Floats in one vector register of the build's target. A generic vector wider than the registers is kept on the
// stack by the compiler (AVX2 builds ran 5-15x slower on 16-float vectors), so every kernel steps by this width.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
constexpr int64_t kLineFloats = 64 / sizeof(float);  // floats per cache line

typedef float lanes_t __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t int_lanes_t __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline lanes_t load_lanes(const float* p) {
  lanes_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store_lanes(float* p, lanes_t v) { std::memcpy(p, &v, sizeof(v)); }

inline lanes_t broadcast(float x) { return lanes_t{} + x; }

inline lanes_t vmax(lanes_t a, lanes_t b) { return a > b ? a : b; }

// Lane j holds j: masks of the first n lanes are `lane_index() < n`.
inline int_lanes_t lane_index() {
  int_lanes_t v;
  for (int32_t j = 0; j < kLanes; ++j) v[j] = j;
  return v;
}

// expf lane-wise in plain vector arithmetic (Cephes' polynomial, ~1 ulp on [-87, 88]): std::exp is a scalar call
// without -ffast-math, and a scalar polynomial in a loop does not vectorize on AVX2 (its clamp's compares may trap).
inline lanes_t vexp(lanes_t x) {
  const lanes_t lo = broadcast(-87.0f), hi = broadcast(88.0f);
  x = x < lo ? lo : x;
  x = hi < x ? hi : x;
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const lanes_t n = (x * 1.44269504088896341f + shifter) - shifter;
  const lanes_t r = x - n * 0.693359375f + n * 2.12194440e-4f;
  lanes_t p = broadcast(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int_lanes_t bits = (__builtin_convertvector(n, int_lanes_t) + 127) << 23;
  lanes_t two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return p * two_n;
}

// Horizontal max and sum by halving shuffles (lane j with lane j ^ half): log2(kLanes) steps, no scalar chain.
inline lanes_t swap_halves(lanes_t v, int32_t half) { return __builtin_shuffle(v, lane_index() ^ half); }

inline float hmax(lanes_t v) {
  for (int32_t half = kLanes / 2; half > 0; half /= 2) v = vmax(v, swap_halves(v, half));
  return v[0];
}

inline float hsum(lanes_t v) {
  for (int32_t half = kLanes / 2; half > 0; half /= 2) v += swap_halves(v, half);
  return v[0];
}

// Rows per parallel chunk for elementwise work of `floats_per_row` floats a row: chunks of ~32K floats, so that a
// decode step's small ops (a few thousand floats) run on the calling thread instead of paying an OpenMP fork and
// join, which costs more than the work itself there.
inline int64_t rows_per_chunk(int64_t floats_per_row) {
  return std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, floats_per_row));
}

inline void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name, " must be a float32 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

}  // namespace raylm
