// y = x W^T (+ bias) for the rows of a decode step (planned up to 128 rows, layers/cpu_gemm.py). At a few rows a
// linear layer is bound by reading its weight from memory: the weight is packed once into panels of kPanel outputs,
// so that a panel streams from memory in one sequential run, and each of its vector loads feeds every row's
// multiply-add (from 1 to 8 rows, over 30 cold layers of SmolLM2's shapes on a 2-core EPYC: oneDNN 16-32 GB/s, this
// kernel 24-47 GB/s). A bfloat16 weight is half the bytes to read; its products are summed in float32.
#pragma once

#include <immintrin.h>

#include <type_traits>

#include "lora_ops.h"

namespace raylm {

constexpr int64_t kPanel = 2 * kLanes;  // outputs per panel: two registers of accumulators per row
// Rows whose accumulators fit the registers (2 per row, beside the weight's 2 and a broadcast): 32 AVX-512 registers,
// 16 AVX2 ones. More rows take further passes over a panel, which is then in L2: 12 rows a pass rather than 8 means
// fewer passes, and more rows fed by the one that reads the panel from memory (1.03-1.14x from 9 to 41 rows).
constexpr int64_t kSkinnyRows = kLanes == 16 ? 12 : 4;

// Whether this build multiplies bfloat16 pairs in one instruction (AVX512-BF16's vdpbf16ps); otherwise each pair
// widens to float32 (a shift and a mask) for two FMAs.
#if defined(__AVX512BF16__)
constexpr bool kNativeBf16 = true;
#else
constexpr bool kNativeBf16 = false;
#endif

// float32 [out, in] -> [ceil(out / kPanel), in, kPanel]; bfloat16 [out, in] -> [ceil(out / kPanel), in2 / 2, kPanel, 2]
// (in2: in rounded up to even), each 32-bit word one output's weights at inputs 2i and 2i + 1, the pair vdpbf16ps
// takes. Outputs (and the odd input) past the weight's are zero.
inline torch::Tensor pack_skinny(torch::Tensor weight) {
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(weight.dim() == 2 && (dtype == torch::kFloat32 || dtype == torch::kBFloat16),
              "weight must be 2-D float32 or bfloat16");
  const int64_t out = weight.size(0), in = weight.size(1), panels = (out + kPanel - 1) / kPanel;
  if (dtype == torch::kFloat32) {
    auto padded = torch::zeros({panels * kPanel, in}, weight.options());
    padded.narrow(0, 0, out).copy_(weight);
    return padded.view({panels, kPanel, in}).transpose(1, 2).contiguous();
  }
  const int64_t pairs = (in + 1) / 2;
  auto padded = torch::zeros({panels * kPanel, 2 * pairs}, weight.options());
  padded.narrow(0, 0, out).narrow(1, 0, in).copy_(weight);
  return padded.view({panels, kPanel, pairs, 2}).permute({0, 2, 1, 3}).contiguous();
}

// Rows [0, N) of x against one float32 panel: y[m][n0 + j] = sum_k x[m][k] * panel[k][j] (+ bias), for the first
// `width` outputs of the panel.
template <int64_t N>
void skinny_panel(const float* x, int64_t x_stride, int64_t in, const float* panel, const float* bias, int64_t n0,
                  int64_t width, float* y, int64_t y_stride) {
  lanes_t lo[N] = {}, hi[N] = {};
  for (int64_t k = 0; k < in; ++k) {
    const lanes_t w_lo = load_lanes(panel + k * kPanel), w_hi = load_lanes(panel + k * kPanel + kLanes);
    for (int64_t m = 0; m < N; ++m) {
      const float xv = x[m * x_stride + k];
      lo[m] += xv * w_lo;
      hi[m] += xv * w_hi;
    }
  }
  for (int64_t m = 0; m < N; ++m) {
    float row[kPanel];
    store_lanes(row, lo[m]);
    store_lanes(row + kLanes, hi[m]);
    float* ym = y + m * y_stride + n0;
    for (int64_t j = 0; j < width; ++j) ym[j] = row[j] + (bias != nullptr ? bias[n0 + j] : 0.0f);
  }
}

// The float32 lanes of a bfloat16 panel's pair words: the even inputs' weights (low halves) or the odd ones' (high).
inline lanes_t even_weights(bits_lanes_t pairs) {
  const bits_lanes_t bits = pairs << 16;
  lanes_t v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

inline lanes_t odd_weights(bits_lanes_t pairs) {
  const bits_lanes_t bits = pairs & 0xffff0000u;
  lanes_t v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

// Rows [0, N) of x against one bfloat16 panel of `pairs` input pairs, as skinny_panel. `x` holds the rows as
// bfloat16 pairs (x_pairs[m * pairs + i]: inputs 2i and 2i + 1) for vdpbf16ps, or as float32 (x_floats[m * 2 * pairs
// + k], the same values widened) for the fallback.
template <int64_t N>
void skinny_panel_bf16(const uint32_t* x_pairs, const float* x_floats, int64_t pairs, const uint16_t* panel,
                       const bf16* bias, int64_t n0, int64_t width, bf16* y, int64_t y_stride) {
  float rows[N][kPanel];
#if defined(__AVX512BF16__)
  static_assert(kLanes == 16, "vdpbf16ps fills 16 float32 lanes");
  (void)x_floats;
  __m512 lo[N], hi[N];
  for (int64_t m = 0; m < N; ++m) lo[m] = hi[m] = _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i) {
    const __m512bh w_lo = (__m512bh)_mm512_loadu_si512(panel + i * 2 * kPanel);
    const __m512bh w_hi = (__m512bh)_mm512_loadu_si512(panel + i * 2 * kPanel + 2 * kLanes);
    for (int64_t m = 0; m < N; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x_pairs[m * pairs + i]));
      lo[m] = _mm512_dpbf16_ps(lo[m], xv, w_lo);
      hi[m] = _mm512_dpbf16_ps(hi[m], xv, w_hi);
    }
  }
  for (int64_t m = 0; m < N; ++m) {
    _mm512_storeu_ps(rows[m], lo[m]);
    _mm512_storeu_ps(rows[m] + kLanes, hi[m]);
  }
#else
  (void)x_pairs;
  lanes_t lo[N] = {}, hi[N] = {};
  for (int64_t i = 0; i < pairs; ++i) {
    bits_lanes_t w_lo, w_hi;
    std::memcpy(&w_lo, panel + i * 2 * kPanel, sizeof(w_lo));
    std::memcpy(&w_hi, panel + i * 2 * kPanel + 2 * kLanes, sizeof(w_hi));
    const lanes_t lo_even = even_weights(w_lo), lo_odd = odd_weights(w_lo);
    const lanes_t hi_even = even_weights(w_hi), hi_odd = odd_weights(w_hi);
    for (int64_t m = 0; m < N; ++m) {
      const float x0 = x_floats[(m * pairs + i) * 2], x1 = x_floats[(m * pairs + i) * 2 + 1];
      lo[m] += x0 * lo_even;
      lo[m] += x1 * lo_odd;
      hi[m] += x0 * hi_even;
      hi[m] += x1 * hi_odd;
    }
  }
  for (int64_t m = 0; m < N; ++m) {
    store_lanes(rows[m], lo[m]);
    store_lanes(rows[m] + kLanes, hi[m]);
  }
#endif
  for (int64_t m = 0; m < N; ++m) {
    bf16* ym = y + m * y_stride + n0;
    for (int64_t j = 0; j < width; ++j)
      ym[j] = from_float<bf16>(rows[m][j] + (bias != nullptr ? to_float(bias[n0 + j]) : 0.0f));
  }
}

// fn(p, m0, std::integral_constant<int64_t, n>) over every panel p and every pass of n rows from row m0: passes of
// equal rows (16 rows: 8 + 8, not 12 + 4), so that none runs a few rows alone. n is a template argument so that the
// kernel's accumulators stay in registers.
template <typename F>
void for_each_pass(int64_t rows, int64_t panels, F&& fn) {
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t passes = (rows + kSkinnyRows - 1) / kSkinnyRows;
      for (int64_t pass = 0; pass < passes; ++pass) {
        const int64_t m0 = pass * rows / passes, m1 = (pass + 1) * rows / passes;
        switch (m1 - m0) {
          case 1: fn(p, m0, std::integral_constant<int64_t, 1>{}); break;
          case 2: fn(p, m0, std::integral_constant<int64_t, 2>{}); break;
          case 3: fn(p, m0, std::integral_constant<int64_t, 3>{}); break;
          case 4: fn(p, m0, std::integral_constant<int64_t, 4>{}); break;
          case 5: fn(p, m0, std::integral_constant<int64_t, 5>{}); break;
          case 6: fn(p, m0, std::integral_constant<int64_t, 6>{}); break;
          case 7: fn(p, m0, std::integral_constant<int64_t, 7>{}); break;
          case 8: fn(p, m0, std::integral_constant<int64_t, 8>{}); break;
          case 9: fn(p, m0, std::integral_constant<int64_t, 9>{}); break;
          case 10: fn(p, m0, std::integral_constant<int64_t, 10>{}); break;
          case 11: fn(p, m0, std::integral_constant<int64_t, 11>{}); break;
          default: fn(p, m0, std::integral_constant<int64_t, kSkinnyRows>{}); break;
        }
      }
    }
  });
}

inline void skinny_linear_bf16(const torch::Tensor& x, const torch::Tensor& packed, int64_t out, const bf16* bias,
                               torch::Tensor& y) {
  const int64_t rows = x.size(0), in = x.size(1), pairs = packed.size(1), x_stride = x.stride(0);
  // x's rows once, zero-padded to whole pairs: as the pairs vdpbf16ps broadcasts, or widened for the fallback.
  std::vector<uint16_t> x_pairs(kNativeBf16 ? rows * 2 * pairs : 0);
  std::vector<float> x_floats(kNativeBf16 ? 0 : rows * 2 * pairs);
  const bf16* xs = data_of<bf16>(x);
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t k = 0; k < in; ++k) {
      if (kNativeBf16) x_pairs[m * 2 * pairs + k] = xs[m * x_stride + k].x;
      else x_floats[m * 2 * pairs + k] = to_float(xs[m * x_stride + k]);
    }
  }
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const auto* xp = reinterpret_cast<const uint32_t*>(x_pairs.data());
  bf16* ys = data_of<bf16>(y);
  for_each_pass(rows, packed.size(0), [&](int64_t p, int64_t m0, auto n) {
    skinny_panel_bf16<decltype(n)::value>(kNativeBf16 ? xp + m0 * pairs : nullptr,
                                          kNativeBf16 ? nullptr : x_floats.data() + m0 * 2 * pairs, pairs,
                                          w + p * pairs * 2 * kPanel, bias, p * kPanel,
                                          std::min(kPanel, out - p * kPanel), ys + m0 * out, out);
  });
}

inline torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor packed, int64_t out,
                                   c10::optional<torch::Tensor> bias) {
  check_rows(x, "x");
  check_same_dtype(packed, x, "packed");
  const bool is_bf16 = x.scalar_type() == torch::kBFloat16;
  const int64_t inputs = is_bf16 ? (x.size(1) + 1) / 2 : x.size(1);  // pairs of inputs in bfloat16
  TORCH_CHECK(packed.is_contiguous() && packed.dim() == (is_bf16 ? 4 : 3) && packed.size(1) == inputs &&
                  packed.size(2) == kPanel && packed.size(0) * kPanel >= out,
              "packed must be pack_skinny's layout of a weight with x's inputs");
  TORCH_CHECK(!bias.has_value() || (bias->is_contiguous() && bias->numel() == out), "bias must have `out` values");
  if (bias.has_value()) check_same_dtype(*bias, x, "bias");
  auto y = torch::empty({x.size(0), out}, x.options());
  if (is_bf16) {
    skinny_linear_bf16(x, packed, out, bias.has_value() ? data_of<bf16>(*bias) : nullptr, y);
    return y;
  }
  const int64_t in = x.size(1), x_stride = x.stride(0);
  const float* xs = x.data_ptr<float>();
  const float* w = packed.data_ptr<float>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* ys = y.data_ptr<float>();
  for_each_pass(x.size(0), packed.size(0), [&](int64_t p, int64_t m0, auto n) {
    skinny_panel<decltype(n)::value>(xs + m0 * x_stride, x_stride, in, w + p * in * kPanel, b, p * kPanel,
                                     std::min(kPanel, out - p * kPanel), ys + m0 * out, out);
  });
  return y;
}

}  // namespace raylm
