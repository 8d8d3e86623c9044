// Dynamic per-token activation quantization of W8A8 int8 and FP8 checkpoints, quantized and dequantized in one pass:
// per row of x, scale = max |x| / half_range (machine epsilon where the row is zero), q = x / scale rounded to int8
// (half to even, clamped to [-128, 127]) or to E4M3 (nearest even, clamped to +-448), y = q * scale. Bit for bit what
// torch's ops compute in x's dtype (checkpoint_formats.quantize_activations, the reference): each op's float32 result
// rounded to bfloat16 where x is bfloat16, as torch's bfloat16 kernels round. One call instead of ~8 torch ops
// (~30-130 us a linear at 32 rows of SmolLM2, most of it the E4M3 cast).
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace raylm {
namespace quant {

// float -> bfloat16 -> float, rounding to nearest even as c10::BFloat16 does (NaN kept a NaN).
inline float round_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  bits = value != value ? 0x7FC00000u : ((bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u);
  std::memcpy(&value, &bits, 4);
  return value;
}

// The E4M3 value nearest to v (ties to even), |v| <= 448 (clamped): 3 mantissa bits from 2^-6 up, multiples of 2^-9
// below (the subnormals), as torch's cast to float8_e4m3fn rounds.
inline float round_e4m3(float v) {
  if (std::fabs(v) < 0.015625f) return std::nearbyint(v * 512.0f) / 512.0f;
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  bits = (bits + 0x7FFFFu + ((bits >> 20) & 1u)) & 0xFFF00000u;
  std::memcpy(&v, &bits, 4);
  return v;
}

template <typename T, bool kFp8>
void quantize_rows(const T* x, T* y, int64_t m, int64_t k) {
  constexpr bool kBf16 = std::is_same_v<T, at::BFloat16>;
  // In x's dtype, as torch computes it: the dtype's rounding after each op, its epsilon for a zero row.
  const auto in_dtype = [](float value) { return kBf16 ? round_bf16(value) : value; };
  const float eps = kBf16 ? 0.0078125f : std::numeric_limits<float>::epsilon();
  const float half_range = kFp8 ? 448.0f : 127.5f;
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = x + r * k;
      float amax = 0.0f;
      for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(static_cast<float>(row[i])));
      float scale = in_dtype(amax / half_range);
      if (scale == 0.0f) scale = eps;
      for (int64_t i = 0; i < k; ++i) {
        const float v = in_dtype(static_cast<float>(row[i]) / scale);
        const float q = kFp8 ? round_e4m3(std::clamp(v, -448.0f, 448.0f))
                             : std::nearbyint(std::clamp(v, -128.0f, 127.0f));
        y[r * k + i] = static_cast<T>(in_dtype(q * scale));
      }
    }
  });
}

// x [..., k] float32 or bfloat16; kind 0: int8, 1: FP8 (E4M3).
inline torch::Tensor quantize_activations(const torch::Tensor& x, int64_t kind) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              "x must be a float32 or bfloat16 CPU tensor");
  TORCH_CHECK(kind == 0 || kind == 1, "kind ", kind, " is not int8 (0) or fp8 (1)");
  const torch::Tensor xs = x.contiguous();
  torch::Tensor y = torch::empty_like(xs);
  const int64_t k = xs.size(-1), m = k == 0 ? 0 : xs.numel() / k;
  if (xs.scalar_type() == torch::kFloat32) {
    if (kind == 1) quantize_rows<float, true>(xs.data_ptr<float>(), y.data_ptr<float>(), m, k);
    else quantize_rows<float, false>(xs.data_ptr<float>(), y.data_ptr<float>(), m, k);
  } else {
    using bf16 = at::BFloat16;
    if (kind == 1) quantize_rows<bf16, true>(xs.data_ptr<bf16>(), y.data_ptr<bf16>(), m, k);
    else quantize_rows<bf16, false>(xs.data_ptr<bf16>(), y.data_ptr<bf16>(), m, k);
  }
  return y;
}

}  // namespace quant
}  // namespace raylm
