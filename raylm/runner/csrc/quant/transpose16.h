// A 16 x 16 block of 32-bit values transposed in AVX-512 registers, for the AMX kernel's packing and write-back.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace raylm {
namespace quant {

// A 16 x 16 block of 32-bit values transposed in registers (rows[i][j] -> rows[j][i]): 64 in-lane shuffles, where
// 16-value gathers cost several times that (and far more on CPUs with the gather-data-sampling fix).
inline void transpose16(__m512 rows[16]) {
  __m512 pairs[16], quads[16];
  for (int i = 0; i < 16; i += 2) {
    pairs[i] = _mm512_unpacklo_ps(rows[i], rows[i + 1]);
    pairs[i + 1] = _mm512_unpackhi_ps(rows[i], rows[i + 1]);
  }
  // quads[4 g + c], 128-bit lane L: rows 4g..4g+3 of column 4L + c.
  for (int g = 0; g < 16; g += 4) {
    for (int h = 0; h < 2; ++h) {
      const __m512d lo = _mm512_castps_pd(pairs[g + h]), hi = _mm512_castps_pd(pairs[g + 2 + h]);
      quads[g + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi));
      quads[g + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi));
    }
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 front01 = _mm512_shuffle_f32x4(quads[c], quads[4 + c], 0x44);
    const __m512 back01 = _mm512_shuffle_f32x4(quads[c], quads[4 + c], 0xEE);
    const __m512 front23 = _mm512_shuffle_f32x4(quads[8 + c], quads[12 + c], 0x44);
    const __m512 back23 = _mm512_shuffle_f32x4(quads[8 + c], quads[12 + c], 0xEE);
    rows[c] = _mm512_shuffle_f32x4(front01, front23, 0x88);
    rows[4 + c] = _mm512_shuffle_f32x4(front01, front23, 0xDD);
    rows[8 + c] = _mm512_shuffle_f32x4(back01, back23, 0x88);
    rows[12 + c] = _mm512_shuffle_f32x4(back01, back23, 0xDD);
  }
}

}  // namespace quant
}  // namespace raylm

#endif  // __AVX512F__
