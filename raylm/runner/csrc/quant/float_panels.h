// y = x W^T for float32 x [M, K] and W [N, K] in blocks, for batches past the few rows that decode blocks in
// registers (block_gemm.cpp's gemm_direct): kPanelOutputs weight rows decoded to float32 into a buffer that stays in
// L1, x packed once per pass as kFloatLanes rows a register (transposed), and each multiply-add takes one register of
// rows of x against one weight, broadcast from the buffer (lanes = rows of x): kPanelOutputs accumulators, written
// back to y once per group of rows. bf16_gemm.h's panels in float32. Plain vectors of the register's width, so every
// build (AVX-512, AVX2, portable) compiles it.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "block_formats.h"

namespace raylm {
namespace quant {

#if defined(__AVX512F__) && !defined(RAYLM_PORTABLE_KERNELS)
constexpr int64_t kFloatLanes = 16;
#else
constexpr int64_t kFloatLanes = 8;
#endif
typedef float float_lanes_t __attribute__((vector_size(kFloatLanes * sizeof(float))));
// Weight rows a panel: one accumulator register each, beside x's register and a broadcast (32 AVX-512 registers,
// 16 AVX2 ones).
constexpr int64_t kPanelOutputs = kFloatLanes == 16 ? 16 : 8;
// Rows of x per pass over W: packed, 256 rows (590 KB at k = 576) stay in L2 while every panel runs against them.
constexpr int64_t kFloatChunkRows = 256;

// x [m, k] as [groups of kFloatLanes rows][k][kFloatLanes]; rows past m are zeros.
inline std::vector<float> pack_columns(const float* x, int64_t m, int64_t k) {
  const int64_t groups = (m + kFloatLanes - 1) / kFloatLanes;
  std::vector<float> packed(groups * k * kFloatLanes, 0.0f);
  for (int64_t r = 0; r < m; ++r) {
    float* dst = packed.data() + (r / kFloatLanes) * k * kFloatLanes + r % kFloatLanes;
    for (int64_t i = 0; i < k; ++i) dst[i * kFloatLanes] = x[r * k + i];
  }
  return packed;
}

// G groups of x's rows (kFloatLanes rows each, pack_columns) against kPanelOutputs / G decoded weight rows, into
// sums[group][output][row]: kPanelOutputs accumulators, and each broadcast weight feeds G multiply-adds.
template <int64_t G>
inline void column_products(const float* panel, int64_t k, const float* xg, float* sums) {
  constexpr int64_t kOutputs = kPanelOutputs / G;
  float_lanes_t acc[kOutputs][G] = {};
  for (int64_t i = 0; i < k; ++i) {
    float_lanes_t xs[G];
    for (int64_t gi = 0; gi < G; ++gi) std::memcpy(&xs[gi], xg + (gi * k + i) * kFloatLanes, sizeof(xs[gi]));
    for (int64_t o = 0; o < kOutputs; ++o) {
      const float weight = panel[o * k + i];
      for (int64_t gi = 0; gi < G; ++gi) acc[o][gi] += xs[gi] * weight;
    }
  }
  for (int64_t o = 0; o < kOutputs; ++o) {
    for (int64_t gi = 0; gi < G; ++gi) std::memcpy(sums + (gi * kPanelOutputs + o) * kFloatLanes, &acc[o][gi],
                                                   sizeof(acc[o][gi]));
  }
}

// Weight rows [n0, n0 + kPanelOutputs) decoded into `panel` (k floats each) against every group of x's rows.
template <class B>
void float_panel_rows(const float* packed, int64_t m, int64_t k, const uint8_t* w, int64_t n, int64_t n0,
                      float* y, float* panel) {
  const int64_t nblocks = k / kBlock, row_bytes = nblocks * B::kBytes;
  const int64_t outputs = std::min(kPanelOutputs, n - n0);
  for (int64_t o = 0; o < kPanelOutputs; ++o) {
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      float* dst = panel + o * k + blk * kBlock;
      if (o < outputs) {
        decode_floats<B>(w + (n0 + o) * row_bytes + blk * B::kBytes, dst);
      } else {
        std::fill(dst, dst + kBlock, 0.0f);
      }
    }
  }
  const int64_t groups = (m + kFloatLanes - 1) / kFloatLanes;
  alignas(64) float sums[2][kPanelOutputs][kFloatLanes];  // [group][output][row of x]
  for (int64_t g = 0; g < groups; g += 2) {
    const float* xg = packed + g * k * kFloatLanes;
    const bool two = g + 1 < groups;
    for (int64_t o0 = 0; o0 < kPanelOutputs; o0 += two ? kPanelOutputs / 2 : kPanelOutputs) {
      if (two) {
        column_products<2>(panel + o0 * k, k, xg, &sums[0][o0][0]);
      } else {
        column_products<1>(panel + o0 * k, k, xg, &sums[0][o0][0]);
      }
    }
    for (int64_t gi = 0; gi < (two ? 2 : 1); ++gi) {
      for (int64_t j = 0; j < kFloatLanes && (g + gi) * kFloatLanes + j < m; ++j) {
        float* row = y + ((g + gi) * kFloatLanes + j) * n + n0;
        for (int64_t o = 0; o < outputs; ++o) row[o] = sums[gi][o][j];
      }
    }
  }
}

template <class B>
void float_panels(const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, float* y) {
  const int64_t panels = (n + kPanelOutputs - 1) / kPanelOutputs;
  for (int64_t m0 = 0; m0 < m; m0 += kFloatChunkRows) {
    const int64_t rows = std::min(kFloatChunkRows, m - m0);
    const std::vector<float> packed = pack_columns(x + m0 * k, rows, k);
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      std::vector<float> panel(kPanelOutputs * k);
      for (int64_t p = p0; p < p1; ++p) {
        float_panel_rows<B>(packed.data(), rows, k, w, n, p * kPanelOutputs, y + m0 * n, panel.data());
      }
    });
  }
}

}  // namespace quant
}  // namespace raylm
