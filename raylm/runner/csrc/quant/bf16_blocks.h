// Each block format decoded to bfloat16, for the kernels that multiply bfloat16 weights (amx_gemm.h on AMX tiles,
// bf16_gemm.h by AVX512-BF16's dot products): 4-bit blocks by a table lookup, byte-a-weight blocks (Q8_0, F8_E4M3)
// widened to float32, scaled and rounded to bfloat16 once. RAYLM_BF16_BLOCKS is defined where the compiler targets
// AVX512-BF16, RAYLM_AMX where it targets AMX-BF16 too (-march=native on a CPU with them).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && !defined(RAYLM_PORTABLE_KERNELS)
#define RAYLM_BF16_BLOCKS 1
#include <immintrin.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define RAYLM_AMX 1
#endif
#endif

#include "block_formats.h"

namespace raylm {
namespace quant {

// Whether a format's blocks decode in lookup order (below): x is packed in the same order, so that the products
// sum the same pairs.
template <class B>
constexpr bool kLookupOrdered = std::is_same_v<B, Q4_0> || std::is_same_v<B, Q4_1>;

// A 4-bit block's 32 weights as bfloat16 in *lookup order*: its 16 bytes broadcast to the four 128-bit lanes, lane L's
// words shifted right by 4 L bits, so word i of lane L holds nibble L of bytes 2i, 2i+1 in its low bits, which look
// up a table of the block's 16 values (q * scale + offset, rounded once). Slot 8 L + i then holds weight
// kLookupOrder[8 L + i] (ggml puts weight j in byte j's low nibble, weight j + 16 in its high one); x is packed in the
// same order, so the products sum the same pairs. vpermw reads 5 index bits: the table is held twice, so the bit
// above the nibble does not matter. Two shuffles a block, where widening the nibbles took seven.
constexpr int16_t kLookupOrder[32] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                      1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};

#ifdef RAYLM_BF16_BLOCKS

inline __m512i lookup_block(const uint8_t* qs, const float& scale, const float& offset) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 values = _mm512_fmadd_ps(iota, _mm512_set1_ps(scale), _mm512_set1_ps(offset));
  const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(values, values);
  const __m512i shifts = _mm512_setr_epi64(0, 0, 0x0004000400040004, 0x0004000400040004, 0x0008000800080008,
                                           0x0008000800080008, 0x000C000C000C000C, 0x000C000C000C000C);
  const __m512i bytes = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  return _mm512_permutexvar_epi16(_mm512_srlv_epi16(bytes, shifts), table);
}

// The float16 at byte `at` of each of a row's blocks, as float32 (16 blocks a conversion).
template <int64_t kBytes>
void row_halves(const uint8_t* row, int64_t nblocks, int64_t at, float* out) {
  constexpr int64_t kLanes = 16;
  for (int64_t b0 = 0; b0 < nblocks; b0 += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, nblocks - b0);
    alignas(32) uint16_t halves[kLanes] = {};
    for (int64_t j = 0; j < count; ++j) std::memcpy(&halves[j], row + (b0 + j) * kBytes + at, 2);
    _mm512_mask_storeu_ps(out + b0, static_cast<__mmask16>((1u << count) - 1),
                          _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(halves))));
  }
}

// Per format: whether its blocks decode in lookup order; for those, where a block's nibbles start and each block's
// scale and offset as float32, converted for a whole row at once; for the others, the block as 32 bfloat16.
template <class B>
struct Bf16Block;

template <>
struct Bf16Block<Q4_0> {
  static constexpr bool kLookup = kLookupOrdered<Q4_0>;
  static constexpr int64_t kValues = 2;
  static void scales(const uint8_t* row, int64_t nblocks, float* scale, float* offset) {
    row_halves<Q4_0::kBytes>(row, nblocks, 0, scale);
    for (int64_t blk = 0; blk < nblocks; ++blk) offset[blk] = -8.0f * scale[blk];
  }
};

template <>
struct Bf16Block<Q4_1> {
  static constexpr bool kLookup = kLookupOrdered<Q4_1>;
  static constexpr int64_t kValues = 4;
  static void scales(const uint8_t* row, int64_t nblocks, float* scale, float* offset) {
    row_halves<Q4_1::kBytes>(row, nblocks, 0, scale);
    row_halves<Q4_1::kBytes>(row, nblocks, 2, offset);
  }
};

// 16 values (float32) times the block's scale, each product rounded to bfloat16 once: [lo, hi] as 32 bfloat16.
inline __m512i scaled_bf16(__m512 lo, __m512 hi, float scale) {
  const __m512 d = _mm512_set1_ps(scale);
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, d), _mm512_mul_ps(lo, d));
}

template <>
struct Bf16Block<Q8_0> {
  static constexpr bool kLookup = false;
  static __m512i decode(const uint8_t* b) {
    const auto ints = [](const uint8_t* q) {
      return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
    };
    return scaled_bf16(ints(b + 2), ints(b + 18), half_to_float(b));
  }
};

// A block's 32 E4M3 bytes as float32, exactly, as block_formats.h's e4m3_floats decodes them: through float16
// (F16C's conversion ignores the denormals-are-zero flag), then times 2^8.
inline void e4m3_floats32(const uint8_t* q, __m512& lo, __m512& hi) {
  const __m512i wide = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
  const __m512i halves = _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi16(wide, 7), _mm512_set1_epi16(0x3F80)),
                                         _mm512_and_si512(_mm512_slli_epi16(wide, 8), _mm512_set1_epi16(-0x8000)));
  const __m512 unit = _mm512_set1_ps(256.0f);
  lo = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(halves)), unit);
  hi = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(halves, 1)), unit);
}

// As Q8_0: the E4M3 values (exact in float32) times the float32 scale, rounded to bfloat16 once.
template <>
struct Bf16Block<F8_E4M3> {
  static constexpr bool kLookup = false;
  static __m512i decode(const uint8_t* b) {
    __m512 lo, hi;
    e4m3_floats32(b + 4, lo, hi);
    return scaled_bf16(lo, hi, float_at(b));
  }
};

#endif  // RAYLM_BF16_BLOCKS

}  // namespace quant
}  // namespace raylm
