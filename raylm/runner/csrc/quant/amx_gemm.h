// y = x W^T for bfloat16 x [M, K] and W [N, K] in blocks (block_formats.h), on AMX tiles: each panel of 32 weight
// rows is decoded once to bfloat16 (bf16_blocks.h) into a buffer that stays in L1/L2, then multiplied by every row of
// x with AMX's bfloat16 tile products (float32 sums). It reads the blocks (0.56-1.13 bytes a weight) instead of a
// bfloat16 copy (2 bytes); the GEMM plan times it against oneDNN on that copy per shape and batch
// (docs/cpu-performance.md has the figures).
//
// The tile product C += A B takes A as 16 rows of 32 bfloat16 and B as 16 rows of 16 bfloat16 pairs (VNNI), so
// C[i][j] = sum_k A[i][k] B'[k][j]. A is the decoded weight panel as it lies (row = output feature), B is x packed
// once per call into pairs (row = pair of input features, column = row of x): C is y transposed, and each C tile is
// transposed in registers on its way back to y. Built only where the compiler targets AMX-BF16 (-march=native on a CPU
// with it); `amx_available()` also needs the kernel's permission to use the tile registers.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_blocks.h"
#include "block_formats.h"
#include "transpose16.h"

#ifdef RAYLM_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace raylm {
namespace quant {

#ifdef RAYLM_AMX

constexpr int64_t kTile = 16;                 // rows of a tile, and x rows per B tile
constexpr int64_t kPanel = 2 * kTile;         // weight rows decoded at once: two A tiles
constexpr int kArchReqXcompPerm = 0x1023;     // arch_prctl: ask for an extended state component
constexpr int kXfeatureXtiledata = 18;        // the tile data registers

// Linux hands out the 8 KB of tile state only to processes that ask (once per process).
inline bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return permitted;
}

// Tiles 0-3: C (16 x 16 float32); 4-5: A (16 weight rows x 32 bfloat16); 6-7: B (16 pairs x 16 rows of x).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = kTile;
  }
  _tile_loadconfig(&config);
}

// Weight rows [n0, n0 + kPanel) as bfloat16 into `panel` (K values a row); rows past n are zeros. `scales` holds
// 2 * nblocks floats (a row's scales, then its offsets).
template <class B>
void decode_panel(const uint8_t* w, int64_t nblocks, int64_t n, int64_t n0, uint16_t* panel, float* scales) {
  const int64_t k = nblocks * kBlock, row_bytes = nblocks * B::kBytes;
  for (int64_t i = 0; i < kPanel; ++i) {
    uint16_t* dst = panel + i * k;
    if (n0 + i >= n) {
      std::memset(dst, 0, k * sizeof(uint16_t));
      continue;
    }
    const uint8_t* row = w + (n0 + i) * row_bytes;
    if constexpr (Bf16Block<B>::kLookup) {
      float* offsets = scales + nblocks;
      Bf16Block<B>::scales(row, nblocks, scales, offsets);
      for (int64_t blk = 0; blk < nblocks; ++blk) {
        _mm512_storeu_si512(dst + blk * kBlock,
                            lookup_block(row + blk * B::kBytes + Bf16Block<B>::kValues, scales[blk], offsets[blk]));
      }
    } else {
      for (int64_t blk = 0; blk < nblocks; ++blk) {
        _mm512_storeu_si512(dst + blk * kBlock, Bf16Block<B>::decode(row + blk * B::kBytes));
      }
    }
  }
}

// x [m, k] bfloat16 as B tiles: for x-row block r (16 rows) and k block b (32 features), 16 rows of 16 pairs,
// pair j of row p = x[16 r + j][32 b + 2 p, + 1] (one transpose of 16 rows' 64 bytes), the block's features
// in lookup order where the weights decode in it. Rows of x past m (to a whole
// block) are zeros. Tile rows are cache lines (torch's allocations are 64-byte aligned): a tile load that splits
// lines runs at half speed.
inline torch::Tensor pack_x(const uint16_t* x, int64_t m, int64_t k, int64_t xblocks, bool lookup_order) {
  const int64_t kblocks = k / kBlock;
  const __m512i order = _mm512_loadu_si512(kLookupOrder);
  torch::Tensor packed = torch::empty({xblocks * kblocks * kTile * kTile}, torch::kInt32);
  float* dst = reinterpret_cast<float*>(packed.data_ptr<int32_t>());
  __m512 rows[kTile];
  for (int64_t r = 0; r < xblocks; ++r) {
    for (int64_t b = 0; b < kblocks; ++b, dst += kTile * kTile) {
      for (int64_t j = 0; j < kTile; ++j) {
        const int64_t row = r * kTile + j;
        rows[j] = row < m ? _mm512_loadu_ps(x + row * k + b * kBlock) : _mm512_setzero_ps();
        if (lookup_order) rows[j] = (__m512)_mm512_permutexvar_epi16(order, (__m512i)rows[j]);
      }
      transpose16(rows);
      for (int64_t p = 0; p < kTile; ++p) _mm512_store_ps(dst + p * kTile, rows[p]);
    }
  }
  return packed;
}

// y[r0 + j][n0 + i] for the tile's 16 weight rows i and 16 rows of x j (the tile transposed), as bfloat16.
inline void write_tile(const float* tile, const float* bias, int64_t n, int64_t n0, int64_t m, int64_t r0,
                       uint16_t* y) {
  const int64_t valid = std::min<int64_t>(kTile, n - n0);
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
  const __m512 add = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, bias + n0);
  __m512 rows[kTile];
  for (int i = 0; i < kTile; ++i) rows[i] = _mm512_load_ps(tile + i * kTile);
  transpose16(rows);
  for (int64_t j = 0; j < kTile && r0 + j < m; ++j) {
    _mm256_mask_storeu_epi16(y + (r0 + j) * n + n0, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(rows[j], add)));
  }
}

// One panel (32 weight rows, decoded) against x-row blocks [xb, xb + XBlocks): C tiles 0-1 (and 2-3 with two x
// blocks) hold the panel's two halves against each block. One x block when x has at most 16 rows (a decode step's
// usual batch), so no tile product is spent on padding rows.
template <int XBlocks>
inline void panel_products(const uint16_t* panel, int64_t k, const uint32_t* b0, float (*c)[kTile * kTile]) {
  const int64_t kblocks = k / kBlock, btile = kTile * kTile;
  _tile_zero(0);
  _tile_zero(1);
  if (XBlocks == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    _tile_loadd(4, panel + kb * kBlock, k * 2);
    _tile_loadd(5, panel + kTile * k + kb * kBlock, k * 2);
    _tile_loadd(6, b0 + kb * btile, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    if (XBlocks == 2) {
      _tile_loadd(7, b0 + (kblocks + kb) * btile, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  for (int t = 0; t < 2 * XBlocks; ++t) {
    switch (t) {  // the tile number must be a constant
      case 0: _tile_stored(0, c[0], 64); break;
      case 1: _tile_stored(1, c[1], 64); break;
      case 2: _tile_stored(2, c[2], 64); break;
      case 3: _tile_stored(3, c[3], 64); break;
    }
  }
}

// Panels decoded per pass over x at most: a group's bfloat16 (36 KB a panel at K = 576) stays in L2 while each pair
// of x blocks, in L1, runs against every panel of it, so x streams from L2 once per group rather than once per panel.
constexpr int64_t kGroupPanels = 8;

template <class B>
void amx_gemm(const uint16_t* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, const float* bias, uint16_t* y) {
  const int64_t kblocks = k / kBlock, xblocks = (m + kTile - 1) / kTile;
  const torch::Tensor packed_x = pack_x(x, m, k, xblocks, Bf16Block<B>::kLookup);
  const uint32_t* packed = reinterpret_cast<const uint32_t*>(packed_x.data_ptr<int32_t>());
  const int64_t btile = kTile * kTile, panels = (n + kPanel - 1) / kPanel;
  // One panel a group where x is a pair of blocks or less (nothing to reuse); else each thread's share of panels in
  // as few groups of at most kGroupPanels as it takes, of equal size, so that the threads' shares stay even.
  const int64_t per_thread = (panels + at::get_num_threads() - 1) / at::get_num_threads();
  const int64_t passes = (per_thread + kGroupPanels - 1) / kGroupPanels;
  const int64_t group = xblocks <= 2 ? 1 : (per_thread + passes - 1) / passes;
  const int64_t groups = (panels + group - 1) / group;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    configure_tiles();
    // Rows of k bfloat16, a multiple of 64 bytes (k is of whole 32-weight blocks), from an aligned start.
    const torch::Tensor panel_buffer = torch::empty({group * kPanel * k}, torch::kInt16);
    uint16_t* panel_base = reinterpret_cast<uint16_t*>(panel_buffer.data_ptr<int16_t>());
    std::vector<float> scales(2 * kblocks);
    alignas(64) float c[4][kTile * kTile];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p0 = g * group, p1 = std::min(panels, p0 + group);
      for (int64_t p = p0; p < p1; ++p) {
        decode_panel<B>(w, kblocks, n, p * kPanel, panel_base + (p - p0) * kPanel * k, scales.data());
      }
      for (int64_t xb = 0; xb < xblocks; xb += 2) {
        const uint32_t* b0 = packed + xb * kblocks * btile;
        const bool pair = xb + 1 < xblocks;
        for (int64_t p = p0; p < p1; ++p) {
          const uint16_t* panel = panel_base + (p - p0) * kPanel * k;
          const int64_t n0 = p * kPanel;
          if (pair) {
            panel_products<2>(panel, k, b0, c);
          } else {
            panel_products<1>(panel, k, b0, c);
          }
          for (int half = 0; half < 2 && n0 + half * kTile < n; ++half) {
            write_tile(c[half], bias, n, n0 + half * kTile, m, xb * kTile, y);
            if (pair) write_tile(c[2 + half], bias, n, n0 + half * kTile, m, (xb + 1) * kTile, y);
          }
        }
      }
    }
    _tile_release();
  });
}

#endif  // RAYLM_AMX

inline bool amx_available() {
#ifdef RAYLM_AMX
  return amx_permitted();
#else
  return false;
#endif
}

}  // namespace quant
}  // namespace raylm
