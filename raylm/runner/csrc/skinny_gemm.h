// y = x W^T (+ bias) for the rows of a decode step (planned up to 128 rows, layers/cpu_gemm.py). At a few rows a
// linear layer is bound by reading its weight from memory: the weight is packed once into panels of kPanel outputs,
// [panels, in, kPanel], so that a panel streams from memory in one sequential run, and each of its vector loads feeds
// every row's multiply-add (from 1 to 8 rows, over 30 cold layers of SmolLM2's shapes on a 2-core EPYC: oneDNN 16-32
// GB/s, this kernel 24-47 GB/s).
#pragma once

#include "lora_ops.h"

namespace raylm {

constexpr int64_t kPanel = 2 * kLanes;  // outputs per panel: two registers of accumulators per row
// Rows whose accumulators fit the registers (2 per row, beside the weight's 2 and a broadcast): 32 AVX-512 registers,
// 16 AVX2 ones. More rows take further passes over a panel, which is then in L2: 12 rows a pass rather than 8 means
// fewer passes, and more rows fed by the one that reads the panel from memory (1.03-1.14x from 9 to 41 rows).
constexpr int64_t kSkinnyRows = kLanes == 16 ? 12 : 4;

// [out, in] -> [ceil(out / kPanel), in, kPanel], outputs past `out` zero.
inline torch::Tensor pack_skinny(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32, "weight must be 2-D float32");
  const int64_t out = weight.size(0), in = weight.size(1), panels = (out + kPanel - 1) / kPanel;
  auto padded = torch::zeros({panels * kPanel, in}, weight.options());
  padded.narrow(0, 0, out).copy_(weight);
  return padded.view({panels, kPanel, in}).transpose(1, 2).contiguous();
}

// Rows [0, N) of x against one panel: y[m][n0 + j] = sum_k x[m][k] * panel[k][j] (+ bias), for the first `width`
// outputs of the panel.
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

inline torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor packed, int64_t out,
                                   c10::optional<torch::Tensor> bias) {
  check_rows(x, "x");
  TORCH_CHECK(packed.is_contiguous() && packed.dim() == 3 && packed.size(1) == x.size(1) &&
                  packed.size(2) == kPanel && packed.size(0) * kPanel >= out,
              "packed must be pack_skinny's layout of a weight with x's inputs");
  TORCH_CHECK(!bias.has_value() || (bias->is_contiguous() && bias->numel() == out), "bias must have `out` values");
  const int64_t rows = x.size(0), in = x.size(1), panels = packed.size(0);
  auto y = torch::empty({rows, out}, x.options());
  const float* xs = x.data_ptr<float>();
  const float* w = packed.data_ptr<float>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* ys = y.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* panel = w + p * in * kPanel;
      const int64_t n0 = p * kPanel, width = std::min(kPanel, out - n0);
      // Passes of equal rows (16 rows: 8 + 8, not 12 + 4), so that none runs a few rows alone.
      const int64_t passes = (rows + kSkinnyRows - 1) / kSkinnyRows;
      for (int64_t pass = 0; pass < passes; ++pass) {
        const int64_t m0 = pass * rows / passes, m1 = (pass + 1) * rows / passes;
        const float* xm = xs + m0 * x_stride;
        float* ym = ys + m0 * out;
        switch (m1 - m0) {
          case 1: skinny_panel<1>(xm, x_stride, in, panel, b, n0, width, ym, out); break;
          case 2: skinny_panel<2>(xm, x_stride, in, panel, b, n0, width, ym, out); break;
          case 3: skinny_panel<3>(xm, x_stride, in, panel, b, n0, width, ym, out); break;
          case 4: skinny_panel<4>(xm, x_stride, in, panel, b, n0, width, ym, out); break;
          case 5: skinny_panel<5>(xm, x_stride, in, panel, b, n0, width, ym, out); break;
          case 6: skinny_panel<6>(xm, x_stride, in, panel, b, n0, width, ym, out); break;
          case 7: skinny_panel<7>(xm, x_stride, in, panel, b, n0, width, ym, out); break;
          case 8: skinny_panel<8>(xm, x_stride, in, panel, b, n0, width, ym, out); break;
          case 9: skinny_panel<9>(xm, x_stride, in, panel, b, n0, width, ym, out); break;
          case 10: skinny_panel<10>(xm, x_stride, in, panel, b, n0, width, ym, out); break;
          case 11: skinny_panel<11>(xm, x_stride, in, panel, b, n0, width, ym, out); break;
          default: skinny_panel<kSkinnyRows>(xm, x_stride, in, panel, b, n0, width, ym, out); break;
        }
      }
    }
  });
  return y;
}

}  // namespace raylm
