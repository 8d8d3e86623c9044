// The block formats decoded on CPU, and the kernel that multiplies few rows of x by a row of blocks.
//   Q4_0: fp16 d, 16 bytes of nibbles;          w = d * (q - 8)     (ggml's)
//   Q4_1: fp16 d, fp16 m, 16 bytes of nibbles;  w = d * q + m       (ggml's)
//   Q8_0: fp16 d, 32 int8;                      w = d * q           (ggml's)
//   F8_E4M3: fp32 d, 32 E4M3 bytes;             w = d * e4m3        (raylm's, for FP8 checkpoints)
// Byte j of a 4-bit block holds weight j (low nibble) and weight j + 16 (high nibble). Each format's decode gives the
// block's values q (integers; F8_E4M3's E4M3 values, exact) with w = q * scale + offset.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace raylm {
namespace quant {

constexpr int64_t kBlock = 32;
// F8_E4M3's kernel switch number (ggml_blocks.F8_E4M3): raylm's own, above ggml's type numbers (under 64 so far).
constexpr int64_t kF8E4M3 = 1024;

// F8_E4M3's float32 scale (stored little endian, as x86 loads it).
inline float float_at(const uint8_t* p) {
  float value;
  std::memcpy(&value, p, 4);
  return value;
}

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// An E4M3 byte as a float, exactly: a normal value's exponent and mantissa shifted into float32's (bias 7 -> 127), a
// subnormal one m * 2^-9, the sign OR-ed in. No float32 subnormal on the way, so the denormals-are-zero flag cannot
// change it.
inline float e4m3_float(uint8_t byte) {
  const uint32_t magnitude = byte & 0x7Fu, normal_bits = (magnitude << 20) + (120u << 23);
  float normal;
  std::memcpy(&normal, &normal_bits, 4);
  float value = magnitude < 8 ? static_cast<float>(magnitude) * (1.0f / 512) : normal;
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  bits |= static_cast<uint32_t>(byte & 0x80u) << 24;
  std::memcpy(&value, &bits, 4);
  return value;
}

// RAYLM_PORTABLE_KERNELS (a build flag) takes the plain-loop path even where AVX2 is present: the tests build it to
// check the path every CPU without AVX2 and FMA runs.
#if defined(__AVX2__) && defined(__FMA__) && !defined(RAYLM_PORTABLE_KERNELS)
// AVX2: a block is four 8-float registers. GCC 12 widens bytes to floats lane by lane when asked through vector
// extensions, so the decode uses intrinsics here. There is no AVX-512 path: AVX-512 CPUs run this one too.
struct Vec {
  __m256 v[4];
};

inline Vec widen_u8(__m128i lo16, __m128i hi16) {
  return {{_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo16)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo16, 8))),
           _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi16)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi16, 8)))}};
}

inline Vec nibbles(const uint8_t* qs) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return widen_u8(_mm_and_si128(bytes, mask), _mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
}

// The block's weights as q (integers) with w = q * scale + offset.
struct Q4_0 {
  static constexpr int64_t kBytes = 18;
  static inline Vec decode(const uint8_t* b, float& scale, float& offset) {
    scale = half_to_float(b);
    offset = -8.0f * scale;
    return nibbles(b + 2);
  }
};

struct Q4_1 {
  static constexpr int64_t kBytes = 20;
  static inline Vec decode(const uint8_t* b, float& scale, float& offset) {
    scale = half_to_float(b);
    offset = half_to_float(b + 2);
    return nibbles(b + 4);
  }
};

struct Q8_0 {
  static constexpr int64_t kBytes = 34;
  static inline Vec decode(const uint8_t* b, float& scale, float& offset) {
    scale = half_to_float(b);
    offset = 0.0f;
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18));
    return {{_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q0)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8))),
             _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q1)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8)))}};
  }
};

// 16 E4M3 bytes as floats, exactly: each byte's magnitude bits shifted into a float16's exponent and mantissa
// (bias 15 for E4M3's 7: every value, subnormals m * 2^-9 too, lands 2^-8 lower, a float16 subnormal or normal) and
// its sign into the float16's, widened by F16C, whose conversion ignores the denormals-are-zero flag (Intel's SDM,
// VCVTPH2PS), then times 2^8 (exact). NaN (0x7F, 0xFF) decodes as 480: FP8 checkpoints hold none.
inline void e4m3_floats(__m128i bytes, __m256& lo, __m256& hi) {
#if defined(__F16C__)
  const __m256i wide = _mm256_cvtepu8_epi16(bytes);
  const __m256i halves = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(wide, 7), _mm256_set1_epi16(0x3F80)),
                                         _mm256_and_si256(_mm256_slli_epi16(wide, 8), _mm256_set1_epi16(-0x8000)));
  const __m256 unit = _mm256_set1_ps(256.0f);
  lo = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(halves)), unit);
  hi = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1)), unit);
#else  // a build for AVX2 and FMA without F16C (by hand: every such CPU has it) decodes byte by byte
  alignas(32) uint8_t b[16];
  alignas(32) float v[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(b), bytes);
  for (int j = 0; j < 16; ++j) v[j] = e4m3_float(b[j]);
  lo = _mm256_load_ps(v);
  hi = _mm256_load_ps(v + 8);
#endif
}

struct F8_E4M3 {
  static constexpr int64_t kBytes = 36;
  static inline Vec decode(const uint8_t* b, float& scale, float& offset) {
    scale = float_at(b);
    offset = 0.0f;
    Vec q;
    e4m3_floats(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4)), q.v[0], q.v[1]);
    e4m3_floats(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 20)), q.v[2], q.v[3]);
    return q;
  }
};

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Rows [n0, n1) of y (ldy floats apart) for R rows of x. Per block, sum(x * w) = scale * sum(x * q) +
// offset * sum(x): the integers meet x directly and the block's x sums (xsum, per row) are made once per call.
template <class B, int R>
void gemm_rows(const float* x, int64_t ldx, const float* xsum, const uint8_t* w, int64_t nblocks, float* y,
               int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t row_bytes = nblocks * B::kBytes;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m256 acc[R];
    float offsets[R];
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_setzero_ps();
      offsets[r] = 0.0f;
    }
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      float scale, offset;
      const Vec q = B::decode(row + blk * B::kBytes, scale, offset);
      const __m256 vscale = _mm256_set1_ps(scale);
      for (int r = 0; r < R; ++r) {
        const float* xb = x + r * ldx + blk * kBlock;
        __m256 dot = _mm256_mul_ps(_mm256_loadu_ps(xb), q.v[0]);
        dot = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), q.v[1], dot);
        dot = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), q.v[2], dot);
        dot = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), q.v[3], dot);
        acc[r] = _mm256_fmadd_ps(dot, vscale, acc[r]);
        offsets[r] += offset * xsum[r * nblocks + blk];
      }
    }
    for (int r = 0; r < R; ++r) y[r * ldy + n] = hsum(acc[r]) + offsets[r];
  }
}

template <class B>
inline void decode_floats(const uint8_t* b, float* dst) {
  float scale, offset;
  const Vec q = B::decode(b, scale, offset);
  const __m256 vscale = _mm256_set1_ps(scale), voffset = _mm256_set1_ps(offset);
  for (int i = 0; i < 4; ++i) _mm256_storeu_ps(dst + 8 * i, _mm256_fmadd_ps(q.v[i], vscale, voffset));
}

#else
// Other CPUs (and portable builds): the same arithmetic in plain loops, which -march=native vectorizes as it can.
struct Vec {
  float v[kBlock];
};

struct Q4_0 {
  static constexpr int64_t kBytes = 18;
  static inline Vec decode(const uint8_t* b, float& scale, float& offset) {
    scale = half_to_float(b);
    offset = -8.0f * scale;
    Vec q;
    for (int j = 0; j < 16; ++j) {
      q.v[j] = static_cast<float>(b[2 + j] & 15);
      q.v[j + 16] = static_cast<float>(b[2 + j] >> 4);
    }
    return q;
  }
};

struct Q4_1 {
  static constexpr int64_t kBytes = 20;
  static inline Vec decode(const uint8_t* b, float& scale, float& offset) {
    scale = half_to_float(b);
    offset = half_to_float(b + 2);
    Vec q;
    for (int j = 0; j < 16; ++j) {
      q.v[j] = static_cast<float>(b[4 + j] & 15);
      q.v[j + 16] = static_cast<float>(b[4 + j] >> 4);
    }
    return q;
  }
};

struct Q8_0 {
  static constexpr int64_t kBytes = 34;
  static inline Vec decode(const uint8_t* b, float& scale, float& offset) {
    scale = half_to_float(b);
    offset = 0.0f;
    Vec q;
    for (int j = 0; j < kBlock; ++j) q.v[j] = static_cast<float>(static_cast<int8_t>(b[2 + j]));
    return q;
  }
};

struct F8_E4M3 {
  static constexpr int64_t kBytes = 36;
  static inline Vec decode(const uint8_t* b, float& scale, float& offset) {
    scale = float_at(b);
    offset = 0.0f;
    Vec q;
    for (int j = 0; j < kBlock; ++j) q.v[j] = e4m3_float(b[4 + j]);
    return q;
  }
};

template <class B, int R>
void gemm_rows(const float* x, int64_t ldx, const float* xsum, const uint8_t* w, int64_t nblocks, float* y,
               int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t row_bytes = nblocks * B::kBytes;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    float acc[R] = {};
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      float scale, offset;
      const Vec q = B::decode(row + blk * B::kBytes, scale, offset);
      for (int r = 0; r < R; ++r) {
        const float* xb = x + r * ldx + blk * kBlock;
        float dot = 0.0f;
        for (int j = 0; j < kBlock; ++j) dot += xb[j] * q.v[j];
        acc[r] += scale * dot + offset * xsum[r * nblocks + blk];
      }
    }
    for (int r = 0; r < R; ++r) y[r * ldy + n] = acc[r];
  }
}

template <class B>
inline void decode_floats(const uint8_t* b, float* dst) {
  float scale, offset;
  const Vec q = B::decode(b, scale, offset);
  for (int j = 0; j < kBlock; ++j) dst[j] = q.v[j] * scale + offset;
}
#endif

}  // namespace quant
}  // namespace raylm
