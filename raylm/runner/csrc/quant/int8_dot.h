// Few rows of x against rows of blocks with integer dot products, as llama.cpp multiplies them: each row of x is
// quantized once per call to int8 per block of 32 (x ~ dx * qx, ggml's Q8_0 rounding; with sx = dx * sum(qx)), and
// per block sum(x * w) = scale * dx * sum(qx * q) + offset * sx for the block's integers q (w = q * scale + offset).
// The 32-product integer sums take one instruction per block and row: vpdpbusd (AVX512-VNNI, or AVX-VNNI where that is
// what the CPU has), else AVX2's vpmaddubsw + vpmaddwd; a 4-bit block's nibbles are its unsigned bytes as they are, a
// Q8_0 block's signs move onto x. It reads x as a quarter of the bytes and skips the float decode of the weights.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "block_formats.h"

namespace raylm {
namespace quant {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
    !defined(RAYLM_PORTABLE_KERNELS)
#define RAYLM_INT8_512 1
#endif

// Rows of x quantized per block: q [m, k] in [-127, 127], d and s [m, nblocks]. The AVX-512 kernel reads d and s / 8
// as 8 lanes a block (d8, s8 [m, nblocks * 8]), so that a pair of blocks takes one load each.
struct Int8Rows {
  std::vector<int8_t> q;
  std::vector<float> d, s, d8, s8;
};

inline Int8Rows quantize_rows(const float* x, int64_t m, int64_t k) {
  const int64_t blocks = m * (k / kBlock);
  Int8Rows out{std::vector<int8_t>(m * k), std::vector<float>(blocks), std::vector<float>(blocks)};
  for (int64_t i = 0; i < blocks; ++i) {
    const float* xb = x + i * kBlock;
    float amax = 0.0f;
    for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int j = 0; j < kBlock; ++j) {
      const int q = static_cast<int>(std::nearbyint(xb[j] * id));  // half to even, as torch.round
      out.q[i * kBlock + j] = static_cast<int8_t>(q);
      sum += q;
    }
    out.d[i] = d;
    out.s[i] = d * static_cast<float>(sum);
  }
#ifdef RAYLM_INT8_512
  out.d8.resize(blocks * 8);
  out.s8.resize(blocks * 8);
  for (int64_t i = 0; i < blocks * 8; ++i) {
    out.d8[i] = out.d[i / 8];
    out.s8[i] = out.s[i / 8] / 8.0f;  // exact: 8 lanes sum back to s
  }
#endif
  return out;
}

// Where each format keeps its integers (4-bit: byte j holds q[j] low, q[j + 16] high; Q8_0: int8) and its offset.
template <class B>
struct Ints;
template <>
struct Ints<Q4_0> {
  static constexpr int kQs = 2;
  static constexpr bool kNibbles = true;
  static float offset(const uint8_t*, float scale) { return -8.0f * scale; }
};
template <>
struct Ints<Q4_1> {
  static constexpr int kQs = 4;
  static constexpr bool kNibbles = true;
  static float offset(const uint8_t* b, float) { return half_to_float(b + 2); }
};
template <>
struct Ints<Q8_0> {
  static constexpr int kQs = 2;
  static constexpr bool kNibbles = false;
  static float offset(const uint8_t*, float) { return 0.0f; }
};

#ifdef RAYLM_INT8_512
constexpr const char* kInt8Path = "avx512_vnni";

// The two fp16 at the start of each of two blocks as [h0(b0), h1(b0), h0(b1), h1(b1)]: both scales (and Q4_1's m)
// in one conversion.
inline __m128 block_halves(const uint8_t* b0, const uint8_t* b1) {
  uint32_t lo, hi = 0;
  std::memcpy(&lo, b0, 4);
  if (b1 != nullptr) std::memcpy(&hi, b1, 4);
  return _mm_cvtph_ps(_mm_set_epi32(0, 0, static_cast<int>(hi), static_cast<int>(lo)));
}

// Lanes 0-7 from element i of v, lanes 8-15 from element j.
inline __m512 spread(__m128 v, int i, int j) {
  return _mm512_permutexvar_ps(_mm512_set_epi32(j, j, j, j, j, j, j, j, i, i, i, i, i, i, i, i),
                               _mm512_castps128_ps512(v));
}

inline __m256i nibbles_u8(const uint8_t* qs) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), _mm256_set1_epi8(0x0F));
}

// Blocks b0 and b0 + 1 of a weight row (b0 alone where kLast: the upper half of every register stays zero) against R
// rows of x (ldx bytes apart; their d8 / s8 ld8 floats apart): acc += scale * dx * dot, off += offset * sx.
template <class B, int R, bool kLast>
inline void pair_step(const uint8_t* b0, const int8_t* xq, int64_t ldx, const float* d8, const float* s8, int64_t ld8,
                      __m512* acc, __m512* off) {
  using I = Ints<B>;
  const uint8_t* b1 = b0 + B::kBytes;
  const __m128 halves = block_halves(b0, kLast ? nullptr : b1);
  const __mmask16 lanes = kLast ? 0x00FF : 0xFFFF;
  const __m512 scale = spread(halves, 0, 2);
  __m512i u;
  __mmask64 negative = 0;
  if constexpr (I::kNibbles) {
    const __m256i hi = kLast ? _mm256_setzero_si256() : nibbles_u8(b1 + I::kQs);
    u = _mm512_inserti64x4(_mm512_castsi256_si512(nibbles_u8(b0 + I::kQs)), hi, 1);
  } else {
    const __m256i hi = kLast ? _mm256_setzero_si256() : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1 + 2));
    const __m512i q = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + 2))), hi, 1);
    u = _mm512_abs_epi8(q);
    negative = _mm512_movepi8_mask(q);
  }
  for (int r = 0; r < R; ++r) {
    const int8_t* xr = xq + r * ldx;
    __m512i xv = kLast ? _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr)))
                       : _mm512_loadu_si512(xr);
    if constexpr (!I::kNibbles) xv = _mm512_mask_sub_epi8(xv, negative, _mm512_setzero_si512(), xv);
    const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, xv));
    acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dot, _mm512_maskz_loadu_ps(lanes, d8 + r * ld8)), scale, acc[r]);
  }
  if constexpr (I::kNibbles) {
    const __m512 offset = I::kQs == 4 ? spread(halves, 1, 3) : _mm512_mul_ps(scale, _mm512_set1_ps(-8.0f));
    for (int r = 0; r < R; ++r) off[r] = _mm512_fmadd_ps(offset, _mm512_maskz_loadu_ps(lanes, s8 + r * ld8), off[r]);
  }
}

// Rows [n0, n1) of y (ldy floats apart) for R rows of quantized x starting at row x0: two blocks a register.
template <class B, int R>
void gemm_rows_int8(const Int8Rows& x, int64_t x0, const uint8_t* w, int64_t nblocks, float* y, int64_t ldy,
                    int64_t n0, int64_t n1) {
  const int64_t row_bytes = nblocks * B::kBytes, k = nblocks * kBlock, ld8 = nblocks * 8;
  const int8_t* xq = x.q.data() + x0 * k;
  const float* d8 = x.d8.data() + x0 * ld8;
  const float* s8 = x.s8.data() + x0 * ld8;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m512 acc[R], off[R];
    for (int r = 0; r < R; ++r) acc[r] = off[r] = _mm512_setzero_ps();
    int64_t blk = 0;
    for (; blk + 2 <= nblocks; blk += 2) {
      pair_step<B, R, false>(row + blk * B::kBytes, xq + blk * kBlock, k, d8 + blk * 8, s8 + blk * 8, ld8, acc, off);
    }
    if (blk < nblocks) {
      pair_step<B, R, true>(row + blk * B::kBytes, xq + blk * kBlock, k, d8 + blk * 8, s8 + blk * 8, ld8, acc, off);
    }
    for (int r = 0; r < R; ++r) y[r * ldy + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], off[r]));
  }
}

#elif defined(__AVX2__) && defined(__FMA__) && !defined(RAYLM_PORTABLE_KERNELS)
#if defined(__AVXVNNI__)
constexpr const char* kInt8Path = "avx_vnni";
#else
constexpr const char* kInt8Path = "avx2";
#endif

// Sums of u * s over each 4 bytes (u unsigned, s signed; no pair of products reaches int16's limit here).
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// Rows [n0, n1) of y (ldy floats apart) for R rows of quantized x starting at row x0.
template <class B, int R>
void gemm_rows_int8(const Int8Rows& x, int64_t x0, const uint8_t* w, int64_t nblocks, float* y, int64_t ldy,
                    int64_t n0, int64_t n1) {
  using I = Ints<B>;
  const int64_t row_bytes = nblocks * B::kBytes, k = nblocks * kBlock;
  const int8_t* xq = x.q.data() + x0 * k;
  const float* xd = x.d.data() + x0 * nblocks;
  const float* xs = x.s.data() + x0 * nblocks;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m256 acc[R];
    float offsets[R];
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_setzero_ps();
      offsets[r] = 0.0f;
    }
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      const uint8_t* b = row + blk * B::kBytes;
      const float scale = half_to_float(b);
      __m256i u, signs;
      if constexpr (I::kNibbles) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + I::kQs));
        u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), _mm256_set1_epi8(0x0F));
      } else {
        signs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + I::kQs));
        u = _mm256_sign_epi8(signs, signs);  // |q|
      }
      for (int r = 0; r < R; ++r) {
        __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * k + blk * kBlock));
        if constexpr (!I::kNibbles) xv = _mm256_sign_epi8(xv, signs);
        const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(u, xv));
        acc[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(scale * xd[r * nblocks + blk]), acc[r]);
      }
      if constexpr (I::kNibbles) {
        const float offset = I::offset(b, scale);
        for (int r = 0; r < R; ++r) offsets[r] += offset * xs[r * nblocks + blk];
      }
    }
    for (int r = 0; r < R; ++r) y[r * ldy + n] = hsum(acc[r]) + offsets[r];
  }
}

#else
constexpr const char* kInt8Path = "portable";

template <class B, int R>
void gemm_rows_int8(const Int8Rows& x, int64_t x0, const uint8_t* w, int64_t nblocks, float* y, int64_t ldy,
                    int64_t n0, int64_t n1) {
  using I = Ints<B>;
  const int64_t row_bytes = nblocks * B::kBytes, k = nblocks * kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    float acc[R] = {};
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      const uint8_t* b = w + n * row_bytes + blk * B::kBytes;
      const float scale = half_to_float(b), offset = I::offset(b, scale);
      int q[kBlock];
      for (int j = 0; j < kBlock / 2; ++j) {
        if constexpr (I::kNibbles) {
          q[j] = b[I::kQs + j] & 15;
          q[j + 16] = b[I::kQs + j] >> 4;
        } else {
          q[j] = static_cast<int8_t>(b[I::kQs + j]);
          q[j + 16] = static_cast<int8_t>(b[I::kQs + j + 16]);
        }
      }
      for (int r = 0; r < R; ++r) {
        const int64_t i = (x0 + r) * nblocks + blk;
        const int8_t* xb = x.q.data() + i * kBlock;
        int dot = 0;
        for (int j = 0; j < kBlock; ++j) dot += q[j] * xb[j];
        acc[r] += scale * x.d[i] * static_cast<float>(dot) + offset * x.s[i];
      }
    }
    for (int r = 0; r < R; ++r) y[r * ldy + n] = acc[r];
  }
}
#endif

}  // namespace quant
}  // namespace raylm
