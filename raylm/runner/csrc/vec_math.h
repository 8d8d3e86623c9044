// Vector helpers shared by the kernels: a vectorisable exp, a 16-float register value, argument checks.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace raylm {

constexpr int64_t kTile = 16;  // floats per vector step

// expf in plain arithmetic (Cephes' polynomial, ~1 ulp on [-87, 88]) so that loops calling it
// vectorize; std::exp stays a scalar call without -ffast-math.
inline float vexp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const float n = (x * 1.44269504088896341f + shifter) - shifter;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return p * two_n;
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

// 16 floats in one value the compiler keeps in registers (one AVX-512 register, or two AVX2 ones), so that
// accumulators across a tile's keys never round-trip through memory.
typedef float vec16 __attribute__((vector_size(kTile * sizeof(float))));

typedef int32_t ivec16 __attribute__((vector_size(kTile * sizeof(int32_t))));
constexpr ivec16 kLanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

inline vec16 load16(const float* p) {
  vec16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, vec16 v) { std::memcpy(p, &v, sizeof(v)); }

// Lane-wise vexp: the loop vectorizes, and the compiler keeps it in registers.
inline vec16 vexp16(vec16 x) {
  float in[kTile], out[kTile];
  store16(in, x);
#pragma omp simd
  for (int64_t j = 0; j < kTile; ++j) out[j] = vexp(in[j]);
  return load16(out);
}

// Horizontal max and sum by halving shuffles: four steps, no scalar chain.
inline vec16 vmax(vec16 a, vec16 b) { return a > b ? a : b; }

inline float hmax16(vec16 v) {
  v = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return v[0];
}

inline float hsum16(vec16 v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

}  // namespace raylm
