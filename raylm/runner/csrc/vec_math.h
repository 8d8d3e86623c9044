// Vector helpers shared by the kernels: one register of floats, a vectorized exp, horizontal reductions, argument
// checks.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace raylm {

// Floats in one vector register of the build's target. A generic vector wider than the registers is kept on the
// stack by the compiler (AVX2 builds ran 5-15x slower on 16-float vectors), so every kernel steps by this width.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
template <typename T>
constexpr int64_t kLineElements = 64 / sizeof(T);  // elements of T per cache line

typedef float lanes_t __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t int_lanes_t __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t bits_lanes_t __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t bf16_lanes_t __attribute__((vector_size(kLanes * sizeof(uint16_t))));

// The kernels' element types: float32, or bfloat16 stored and float32 computed (every load widens, every store rounds).
using bf16 = at::BFloat16;

// A bfloat16 is a float32's top 16 bits: widening is a shift; narrowing rounds to nearest even (as torch does).
inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
inline T from_float(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    return bf16(x != x ? uint16_t{0x7fc0} : static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16),
                bf16::from_bits());
  }
}

// x as a T holds it: rounded to bfloat16 and widened back, or x itself for float.
template <typename T>
inline float round_to(float x) { return to_float(from_float<T>(x)); }

inline lanes_t load_lanes(const float* p) {
  lanes_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline lanes_t load_lanes(const bf16* p) {
  bf16_lanes_t h;
  std::memcpy(&h, p, sizeof(h));
  const bits_lanes_t bits = __builtin_convertvector(h, bits_lanes_t) << 16;
  lanes_t v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

inline void store_lanes(float* p, lanes_t v) { std::memcpy(p, &v, sizeof(v)); }

// The float32 bits of v rounded to nearest even at bfloat16's precision (the low 16 bits left to clear); NaN stays NaN.
inline bits_lanes_t rounded_bits(lanes_t v) {
  bits_lanes_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return v != v ? bits_lanes_t{} + 0x7fc00000u : bits;
}

inline void store_lanes(bf16* p, lanes_t v) {
  const bf16_lanes_t h = __builtin_convertvector(rounded_bits(v) >> 16, bf16_lanes_t);
  std::memcpy(p, &h, sizeof(h));
}

// v as T holds it, lane-wise (round_to's vector form).
template <typename T>
inline lanes_t round_lanes(lanes_t v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    const bits_lanes_t bits = rounded_bits(v) & 0xffff0000u;
    lanes_t rounded;
    std::memcpy(&rounded, &bits, sizeof(rounded));
    return rounded;
  }
}

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
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16),
              name, " must be a float32 or bfloat16 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

inline void check_same_dtype(const torch::Tensor& t, const torch::Tensor& like, const char* name) {
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " must have the activations' dtype (",
              like.scalar_type(), "), not ", t.scalar_type());
}

// fn(T{}) with T the element type of `t`: float for float32, bf16 for bfloat16.
template <typename F>
inline auto dispatch_float(const torch::Tensor& t, F&& fn) {
  if (t.scalar_type() == torch::kBFloat16) return fn(bf16{});
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, "the CPU kernels take float32 or bfloat16, not ", t.scalar_type());
  return fn(float{});
}

template <typename T>
inline T* data_of(const torch::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

}  // namespace raylm
