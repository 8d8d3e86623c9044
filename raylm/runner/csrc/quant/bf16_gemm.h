// y = x W^T (+ bias) for bfloat16 x [M, K] and W [N, K] in blocks (block_formats.h) by AVX512-BF16's dot products
// (vdpbf16ps: float32 sums of bfloat16 pairs), for CPUs without AMX; amx_gemm.h is the same idea on tiles. Each block
// is decoded to bfloat16 (bf16_blocks.h) once per call, so the kernel reads the blocks (0.56-1.13 bytes a weight)
// where a float kernel on a dequantized copy reads 2 or 4. Two ways, by the rows of x:
// - few rows (direct_rows): each weight row's blocks decoded in registers and multiplied along k by every row of x
//   (lanes = inputs), each sum reduced across its lanes once at the row's end. Nothing is written but y.
// - more rows (panel_rows): 16 weight rows decoded into a buffer that stays in L1, x packed once per 256-row pass as
//   pairs of inputs of 16 rows a register (transposed), and each dot product takes 16 rows of x against one weight
//   row's pair, broadcast from the buffer (lanes = rows of x; one broadcast feeds two groups of rows where there are
//   two): 16 accumulators, transposed back to y once per group of rows.
// x is packed with each block's inputs in the order its weights decode (lookup order for 4-bit blocks), so that the
// products sum the same pairs. Builds without AVX512-BF16 have no such kernel (`bf16_dot_available`).
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bf16_blocks.h"
#include "block_formats.h"
#include "transpose16.h"

namespace raylm {
namespace quant {

constexpr int64_t kGroup = 16;       // weight rows decoded at once; rows of x in one register (panel_rows)
constexpr int64_t kDirectRows = 8;  // rows of x taken at once by direct_rows: one accumulator register each
// Batches of up to this many rows take direct_rows, larger ones panels: on a 2-core EPYC (Zen 4) direct ran 1.7-2.4x
// panels at 4-8 rows, and they were even at 16.
constexpr int64_t kMaxDirectRowsBf16 = 8;

#ifdef RAYLM_BF16_BLOCKS

// A weight row's block `blk` as 32 bfloat16 in slot order; `scales` and `offsets` hold the row's (4-bit blocks).
template <class B>
inline __m512i decode_bf16(const uint8_t* row, int64_t blk, const float* scales, const float* offsets) {
  if constexpr (Bf16Block<B>::kLookup) {
    return lookup_block(row + blk * B::kBytes + Bf16Block<B>::kValues, scales[blk], offsets[blk]);
  } else {
    return Bf16Block<B>::decode(row + blk * B::kBytes);
  }
}

// x [m, k] as bfloat16 in slot order, each block's inputs in the order its weights decode: x itself, or for 4-bit
// blocks x permuted into lookup order in `buffer`.
template <class B>
const uint16_t* slot_order(const uint16_t* x, int64_t m, int64_t k, std::vector<uint16_t>& buffer) {
  if constexpr (!kLookupOrdered<B>) return x;
  buffer.resize(m * k);
  const __m512i order = _mm512_loadu_si512(kLookupOrder);
  for (int64_t i = 0; i < m * k; i += kBlock) {
    _mm512_storeu_si512(buffer.data() + i, _mm512_permutexvar_epi16(order, _mm512_loadu_si512(x + i)));
  }
  return buffer.data();
}

template <class B, int64_t R>
void direct_rows(const uint16_t* x, int64_t k, const uint8_t* w, int64_t n0, int64_t n1, const float* bias,
                 uint16_t* y, int64_t n, float* scales) {
  const int64_t nblocks = k / kBlock, row_bytes = nblocks * B::kBytes;
  float* offsets = scales + nblocks;
  for (int64_t o = n0; o < n1; ++o) {
    const uint8_t* row = w + o * row_bytes;
    if constexpr (Bf16Block<B>::kLookup) Bf16Block<B>::scales(row, nblocks, scales, offsets);
    // Two accumulators a row, for even and odd blocks: at one or two rows a single chain of dot products would wait
    // on each one's latency.
    __m512 even[R], odd[R];
    for (int64_t r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
    int64_t blk = 0;
    for (; blk + 1 < nblocks; blk += 2) {
      const __m512bh first = (__m512bh)decode_bf16<B>(row, blk, scales, offsets);
      const __m512bh second = (__m512bh)decode_bf16<B>(row, blk + 1, scales, offsets);
      for (int64_t r = 0; r < R; ++r) {
        const uint16_t* xs = x + r * k + blk * kBlock;
        even[r] = _mm512_dpbf16_ps(even[r], (__m512bh)_mm512_loadu_si512(xs), first);
        odd[r] = _mm512_dpbf16_ps(odd[r], (__m512bh)_mm512_loadu_si512(xs + kBlock), second);
      }
    }
    if (blk < nblocks) {
      const __m512bh last = (__m512bh)decode_bf16<B>(row, blk, scales, offsets);
      for (int64_t r = 0; r < R; ++r) {
        even[r] = _mm512_dpbf16_ps(even[r], (__m512bh)_mm512_loadu_si512(x + r * k + blk * kBlock), last);
      }
    }
    const float add = bias != nullptr ? bias[o] : 0.0f;
    for (int64_t r = 0; r < R; ++r) {
      y[r * n + o] = c10::BFloat16(_mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r])) + add).x;
    }
  }
}

template <class B>
void direct_gemm(const uint16_t* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, const float* bias,
                 uint16_t* y) {
  const int64_t passes = (m + kDirectRows - 1) / kDirectRows;
  // ~64K weights a chunk, so that a small decode matmul stays on the calling thread.
  at::parallel_for(0, n, std::max<int64_t>(1, (int64_t{1} << 16) / k), [&](int64_t n0, int64_t n1) {
    std::vector<float> scales(2 * (k / kBlock));
    for (int64_t pass = 0; pass < passes; ++pass) {  // passes of equal rows, none running a few rows alone
      const int64_t m0 = pass * m / passes, rows = (pass + 1) * m / passes - m0;
      const uint16_t* xs = x + m0 * k;
      uint16_t* ys = y + m0 * n;
      switch (rows) {
        case 1: direct_rows<B, 1>(xs, k, w, n0, n1, bias, ys, n, scales.data()); break;
        case 2: direct_rows<B, 2>(xs, k, w, n0, n1, bias, ys, n, scales.data()); break;
        case 3: direct_rows<B, 3>(xs, k, w, n0, n1, bias, ys, n, scales.data()); break;
        case 4: direct_rows<B, 4>(xs, k, w, n0, n1, bias, ys, n, scales.data()); break;
        case 5: direct_rows<B, 5>(xs, k, w, n0, n1, bias, ys, n, scales.data()); break;
        case 6: direct_rows<B, 6>(xs, k, w, n0, n1, bias, ys, n, scales.data()); break;
        case 7: direct_rows<B, 7>(xs, k, w, n0, n1, bias, ys, n, scales.data()); break;
        default: direct_rows<B, kDirectRows>(xs, k, w, n0, n1, bias, ys, n, scales.data()); break;
      }
    }
  });
}

// x (slot order) as [groups of 16 rows][k / 2 pairs][16 rows] words, a word one row's two inputs; rows past m zero.
inline std::vector<uint32_t> pack_pairs(const uint16_t* slots, int64_t m, int64_t k) {
  const int64_t pairs = k / 2, groups = (m + kGroup - 1) / kGroup;
  std::vector<uint32_t> packed(groups * pairs * kGroup);
  __m512 rows[kGroup];
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t p0 = 0; p0 < pairs; p0 += kGroup) {  // pairs is a multiple of 16: k is of whole 32-input blocks
      for (int64_t j = 0; j < kGroup; ++j) {
        const int64_t row = g * kGroup + j;
        rows[j] = row < m ? _mm512_loadu_ps(slots + row * k + 2 * p0) : _mm512_setzero_ps();
      }
      transpose16(rows);
      for (int64_t q = 0; q < kGroup; ++q) _mm512_storeu_ps(packed.data() + (g * pairs + p0 + q) * kGroup, rows[q]);
    }
  }
  return packed;
}

// G groups of x's rows (16 rows each, pack_pairs) against 16 / G decoded weight rows (`words`: k / 2 pair words
// each), into sums[group][output][row]: 16 accumulators, and each broadcast weight pair feeds G products.
template <int64_t G>
inline void group_products(const uint32_t* words, int64_t pairs, const uint32_t* xg, float* sums) {
  constexpr int64_t kOutputs = kGroup / G;
  __m512 acc[kOutputs][G];
  for (int64_t o = 0; o < kOutputs; ++o) {
    for (int64_t gi = 0; gi < G; ++gi) acc[o][gi] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh xs[G];
    for (int64_t gi = 0; gi < G; ++gi) xs[gi] = (__m512bh)_mm512_loadu_si512(xg + (gi * pairs + p) * kGroup);
    for (int64_t o = 0; o < kOutputs; ++o) {
      const __m512bh weight = (__m512bh)_mm512_set1_epi32(static_cast<int>(words[o * pairs + p]));
      for (int64_t gi = 0; gi < G; ++gi) acc[o][gi] = _mm512_dpbf16_ps(acc[o][gi], xs[gi], weight);
    }
  }
  for (int64_t o = 0; o < kOutputs; ++o) {
    for (int64_t gi = 0; gi < G; ++gi) _mm512_store_ps(sums + (gi * kGroup + o) * kGroup, acc[o][gi]);
  }
}

// Weight rows [n0, n0 + 16) decoded into `panel` (16 rows of k bfloat16) against every group of x's rows.
template <class B>
void panel_rows(const uint32_t* packed, int64_t m, int64_t k, const uint8_t* w, int64_t n, int64_t n0,
                const float* bias, uint16_t* y, uint16_t* panel, float* scales) {
  const int64_t nblocks = k / kBlock, pairs = k / 2, row_bytes = nblocks * B::kBytes;
  const int64_t outputs = std::min(kGroup, n - n0);
  for (int64_t o = 0; o < kGroup; ++o) {
    if (o >= outputs) {  // past the last weight row: zeros
      std::fill(panel + o * k, panel + (o + 1) * k, uint16_t{0});
      continue;
    }
    const uint8_t* row = w + (n0 + o) * row_bytes;
    if constexpr (Bf16Block<B>::kLookup) Bf16Block<B>::scales(row, nblocks, scales, scales + nblocks);
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      _mm512_storeu_si512(panel + o * k + blk * kBlock, decode_bf16<B>(row, blk, scales, scales + nblocks));
    }
  }
  const auto* words = reinterpret_cast<const uint32_t*>(panel);
  const __mmask16 valid = static_cast<__mmask16>((1u << outputs) - 1);
  const __m512 add = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(valid, bias + n0);
  const int64_t groups = (m + kGroup - 1) / kGroup;
  alignas(64) float sums[2][kGroup][kGroup];  // [group][output][row of x]
  for (int64_t g = 0; g < groups; g += 2) {
    const uint32_t* xg = packed + g * pairs * kGroup;
    const bool two = g + 1 < groups;
    for (int64_t o0 = 0; o0 < kGroup; o0 += two ? kGroup / 2 : kGroup) {
      if (two) {
        group_products<2>(words + o0 * pairs, pairs, xg, &sums[0][o0][0]);
      } else {
        group_products<1>(words + o0 * pairs, pairs, xg, &sums[0][o0][0]);
      }
    }
    for (int64_t gi = 0; gi < (two ? 2 : 1); ++gi) {
      __m512 rows[kGroup];
      for (int64_t o = 0; o < kGroup; ++o) rows[o] = _mm512_load_ps(sums[gi][o]);
      transpose16(rows);  // rows[j]: row (g + gi) * 16 + j of y for the 16 outputs
      const int64_t r0 = (g + gi) * kGroup;
      for (int64_t j = 0; j < kGroup && r0 + j < m; ++j) {
        _mm256_mask_storeu_epi16(y + (r0 + j) * n + n0, valid,
                                 (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(rows[j], add)));
      }
    }
  }
}

// Rows of x per pass over W: packed, 256 rows (295 KB at k = 576) stay in L2 while every panel runs against them;
// each pass decodes W again, a cost spread over 256 rows.
constexpr int64_t kChunkRows = 256;

template <class B>
void panel_gemm(const uint16_t* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, const float* bias,
                uint16_t* y) {
  const int64_t panels = (n + kGroup - 1) / kGroup;
  for (int64_t m0 = 0; m0 < m; m0 += kChunkRows) {
    const int64_t rows = std::min(kChunkRows, m - m0);
    const std::vector<uint32_t> packed = pack_pairs(x + m0 * k, rows, k);
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      std::vector<uint16_t> panel(kGroup * k);
      std::vector<float> scales(2 * (k / kBlock));
      for (int64_t p = p0; p < p1; ++p) {
        panel_rows<B>(packed.data(), rows, k, w, n, p * kGroup, bias, y + m0 * n, panel.data(), scales.data());
      }
    });
  }
}

// x [m, k] bfloat16, bias float32 [n] or nullptr, y bfloat16 [m, n]: direct_rows up to max_direct_rows rows of x.
template <class B>
void bf16_gemm(const uint16_t* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, const float* bias, uint16_t* y,
               int64_t max_direct_rows) {
  std::vector<uint16_t> buffer;
  const uint16_t* slots = slot_order<B>(x, m, k, buffer);
  if (m <= max_direct_rows) {
    direct_gemm<B>(slots, m, k, w, n, bias, y);
  } else {
    panel_gemm<B>(slots, m, k, w, n, bias, y);
  }
}

#endif  // RAYLM_BF16_BLOCKS

inline bool bf16_dot_available() {
#ifdef RAYLM_BF16_BLOCKS
  return true;
#else
  return false;
#endif
}

}  // namespace quant
}  // namespace raylm
