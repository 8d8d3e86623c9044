// y = x W^T for bfloat16 x [M, K] and W [N, K] in ggml blocks, on AMX tiles: each panel of 32 weight rows is decoded
// once to bfloat16 into a buffer that stays in L1/L2, then multiplied by every row of x with AMX's bfloat16 tile
// products (float32 sums). It reads the blocks (0.56-1.06 bytes a weight) instead of a bfloat16 copy (2 bytes): on a
// Sapphire Rapids VM it beat oneDNN on that copy from 2 to 16-32 rows; past that the tile products cost more than the
// bytes saved, and the GEMM plan keeps oneDNN there (docs/cpu-performance.md).
//
// The tile product C += A B takes A as 16 rows of 32 bfloat16 and B as 16 rows of 16 bfloat16 pairs (VNNI), so
// C[i][j] = sum_k A[i][k] B'[k][j]. A is the decoded weight panel as it lies (row = output feature), B is x packed
// once per call into pairs (row = pair of input features, column = row of x): C is y transposed, and each C tile is
// written back to y column by column. Built only where the compiler targets AMX-BF16 (-march=native on a CPU with
// it); `amx_available()` also needs the kernel's permission to use the tile registers.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && !defined(RAYLM_PORTABLE_KERNELS)
#define RAYLM_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "block_formats.h"

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

// One block's 32 weights as bfloat16 (q * scale + offset rounded once, as the dequantized copy holds them). A 4-bit
// block looks its nibbles up in a table of its 16 possible values, which costs less than widening every nibble to a
// float: the decode, not the tile products, is what bounds this kernel.
inline __m512i lookup_nibbles(const uint8_t* qs, float scale, float offset) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m256i table = (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(iota, _mm512_set1_ps(scale), _mm512_set1_ps(offset)));
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), mask = _mm_set1_epi8(0x0F);
  const __m256i nibbles = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), _mm_and_si128(bytes, mask));
  return _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(nibbles), _mm512_castsi256_si512(table));
}

template <class B>
inline __m512i decode_block(const uint8_t* b);

template <>
inline __m512i decode_block<Q4_0>(const uint8_t* b) {
  const float scale = half_to_float(b);
  return lookup_nibbles(b + 2, scale, -8.0f * scale);
}

template <>
inline __m512i decode_block<Q4_1>(const uint8_t* b) {
  return lookup_nibbles(b + 4, half_to_float(b), half_to_float(b + 2));
}

template <>
inline __m512i decode_block<Q8_0>(const uint8_t* b) {
  const __m512 scale = _mm512_set1_ps(half_to_float(b));
  const __m512 lo = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)))), scale);
  const __m512 hi = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18)))), scale);
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

// Weight rows [n0, n0 + kPanel) as bfloat16 into `panel` (K values a row); rows past n are zeros.
template <class B>
void decode_panel(const uint8_t* w, int64_t nblocks, int64_t n, int64_t n0, uint16_t* panel) {
  const int64_t k = nblocks * kBlock, row_bytes = nblocks * B::kBytes;
  for (int64_t i = 0; i < kPanel; ++i) {
    uint16_t* dst = panel + i * k;
    if (n0 + i >= n) {
      std::memset(dst, 0, k * sizeof(uint16_t));
      continue;
    }
    const uint8_t* row = w + (n0 + i) * row_bytes;
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      _mm512_storeu_si512(dst + blk * kBlock, decode_block<B>(row + blk * B::kBytes));
    }
  }
}

// x [m, k] bfloat16 as B tiles: for x-row block r (16 rows) and k block b (32 features), 16 rows of 16 pairs,
// pair j of row p = x[16 r + j][32 b + 2 p, + 1]. Rows of x past m (to a whole block) are zeros. Tile rows are
// cache lines (torch's allocations are 64-byte aligned): a tile load that splits lines runs at half speed.
inline torch::Tensor pack_x(const uint16_t* x, int64_t m, int64_t k, int64_t xblocks) {
  const int64_t kblocks = k / kBlock;
  torch::Tensor packed = torch::zeros({xblocks * kblocks * kTile * kTile}, torch::kInt32);
  for (int64_t row = 0; row < m; ++row) {
    const uint32_t* pairs = reinterpret_cast<const uint32_t*>(x + row * k);
    uint32_t* dst = reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>()) +
                    (row / kTile) * kblocks * kTile * kTile + row % kTile;
    for (int64_t pair = 0; pair < k / 2; ++pair) dst[(pair / kTile) * kTile * kTile + (pair % kTile) * kTile] = pairs[pair];
  }
  return packed;
}

// y[row][n0 + i] for the tile's 16 weight rows i and 16 rows of x (tile column j = row r0 + j), as bfloat16.
inline void write_tile(const float* tile, const float* bias, int64_t n, int64_t n0, int64_t m, int64_t r0,
                       uint16_t* y) {
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(kTile));
  const int64_t valid = std::min<int64_t>(kTile, n - n0);
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
  const __m512 add = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, bias + n0);
  for (int64_t j = 0; j < kTile && r0 + j < m; ++j) {
    const __m512 values = _mm512_add_ps(_mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32(j)), tile, 4), add);
    _mm256_mask_storeu_epi16(y + (r0 + j) * n + n0, mask, (__m256i)_mm512_cvtneps_pbh(values));
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

template <class B>
void amx_gemm(const uint16_t* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, const float* bias, uint16_t* y) {
  const int64_t kblocks = k / kBlock, xblocks = (m + kTile - 1) / kTile;
  const torch::Tensor packed_x = pack_x(x, m, k, xblocks);
  const uint32_t* packed = reinterpret_cast<const uint32_t*>(packed_x.data_ptr<int32_t>());
  const int64_t btile = kTile * kTile, panels = (n + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    configure_tiles();
    // Rows of k bfloat16, a multiple of 64 bytes (k is of whole 32-weight blocks), from an aligned start.
    const torch::Tensor panel_buffer = torch::empty({kPanel * k}, torch::kInt16);
    uint16_t* panel = reinterpret_cast<uint16_t*>(panel_buffer.data_ptr<int16_t>());
    alignas(64) float c[4][kTile * kTile];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kPanel;
      decode_panel<B>(w, kblocks, n, n0, panel);
      for (int64_t xb = 0; xb < xblocks; xb += 2) {
        const uint32_t* b0 = packed + xb * kblocks * btile;
        const bool pair = xb + 1 < xblocks;
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
