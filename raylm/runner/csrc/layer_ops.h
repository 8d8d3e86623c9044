// The decoder's elementwise steps, fused: RMSNorm (optionally with the residual add), SiLU-and-mul and
// neox rotary. One pass over memory each, threads over rows.
#pragma once

#include "vec_math.h"

namespace raylm {

// x[i] = rmsnorm(x[i] (+ residual[i])) * weight; with a residual, residual[i] becomes the sum first. In bfloat16 each
// step rounds where transformers' bfloat16 RMSNorm rounds: the sum, the normalized row, its product with the weight.
template <typename T>
void rms_norm_rows(T* x, int64_t x_stride, T* residual, const T* weight, int64_t rows, int64_t hidden, float eps,
                   T* out, int64_t out_stride) {
  at::parallel_for(0, rows, rows_per_chunk(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      T* xi = x + i * x_stride;
      T* src = xi;
      if (residual != nullptr) {
        src = residual + i * hidden;
#pragma omp simd
        for (int64_t d = 0; d < hidden; ++d) src[d] = from_float<T>(to_float(src[d]) + to_float(xi[d]));
      }
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t d = 0; d < hidden; ++d) sum += to_float(src[d]) * to_float(src[d]);
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(hidden) + eps);
      T* oi = out + i * out_stride;
#pragma omp simd
      for (int64_t d = 0; d < hidden; ++d)
        oi[d] = from_float<T>(to_float(weight[d]) * round_to<T>(to_float(src[d]) * inv));
    }
  });
}

inline torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_same_dtype(weight, x, "weight");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  dispatch_float(x, [&](auto tag) {
    using T = decltype(tag);
    rms_norm_rows<T>(data_of<T>(x), x.stride(0), nullptr, data_of<T>(weight), x.size(0), x.size(1),
                     static_cast<float>(eps), data_of<T>(out), out.stride(0));
  });
  return out;
}

// In place, as vLLM's op: residual += x, then x = rmsnorm(residual) * weight.
inline void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes(), "residual must be contiguous, like x");
  check_same_dtype(residual, x, "residual");
  check_same_dtype(weight, x, "weight");
  dispatch_float(x, [&](auto tag) {
    using T = decltype(tag);
    rms_norm_rows<T>(data_of<T>(x), x.stride(0), data_of<T>(residual), data_of<T>(weight), x.size(0), x.size(1),
                     static_cast<float>(eps), data_of<T>(x), x.stride(0));
  });
}

// [T, 2d] -> [T, d]: silu(gate) * up with gate the first half, silu(g) = g / (1 + exp(-g)); in bfloat16 silu(g) is
// rounded before the product, as transformers' bfloat16 MLP rounds it.
template <typename T>
void silu_and_mul_rows(const T* in, int64_t in_stride, int64_t rows, int64_t d, T* o) {
  at::parallel_for(0, rows, rows_per_chunk(2 * d), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* gate = in + i * in_stride;
      const T* up = gate + d;
      T* oi = o + i * d;
      auto silu_mul = [](const T* g, const T* u, T* y) {
        const lanes_t gv = load_lanes(g);
        store_lanes(y, round_lanes<T>(gv / (1.0f + vexp(-gv))) * load_lanes(u));
      };
      int64_t j = 0;
      for (; j + kLanes <= d; j += kLanes) silu_mul(gate + j, up + j, oi + j);
      if (j < d) {  // the row's last elements, through one register's worth of zero-padded ones
        T g[kLanes] = {}, u[kLanes] = {}, y[kLanes];
        std::copy(gate + j, gate + d, g);
        std::copy(up + j, up + d, u);
        silu_mul(g, u, y);
        std::copy(y, y + (d - j), oi + j);
      }
    }
  });
}

inline torch::Tensor silu_and_mul(torch::Tensor x) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  auto out = torch::empty({rows, d}, x.options());
  dispatch_float(x, [&](auto tag) {
    using T = decltype(tag);
    silu_and_mul_rows<T>(data_of<T>(x), x.stride(0), rows, d, data_of<T>(out));
  });
  return out;
}

// Neox-style rotary in place on query [T, Hq*D] and key [T, Hk*D]: within each head the first and
// second halves of the rotary dims rotate together. cos_sin_cache [max_pos, rotary_dim]: cos | sin, float32.
template <typename T>
void rotary_rows(const int64_t* pos, T* q, int64_t q_stride, int64_t q_heads, T* k, int64_t k_stride, int64_t k_heads,
                 int64_t num_tokens, const float* cache, int64_t head_size, int64_t rotary_dim) {
  const int64_t half = rotary_dim / 2;
  const int64_t grain = rows_per_chunk((q_heads + k_heads) * rotary_dim);
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = cache + pos[t] * rotary_dim;
      const float* sin = cos + half;
      for (int64_t h = 0; h < q_heads + k_heads; ++h) {
        T* x1 = h < q_heads ? q + t * q_stride + h * head_size : k + t * k_stride + (h - q_heads) * head_size;
        T* x2 = x1 + half;
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          const float a = to_float(x1[j]), b = to_float(x2[j]);
          x1[j] = from_float<T>(a * cos[j] - b * sin[j]);
          x2[j] = from_float<T>(b * cos[j] + a * sin[j]);
        }
      }
    }
  });
}

inline void rotary_embedding(torch::Tensor positions, torch::Tensor query, torch::Tensor key,
                             torch::Tensor cos_sin_cache, int64_t head_size, int64_t rotary_dim) {
  check_rows(query, "query");
  check_rows(key, "key");
  check_same_dtype(key, query, "key");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous(), "positions must be int64");
  TORCH_CHECK(cos_sin_cache.is_contiguous() && cos_sin_cache.size(1) == rotary_dim &&
                  cos_sin_cache.scalar_type() == torch::kFloat32,
              "bad cos_sin_cache: [max_pos, rotary_dim] float32");
  dispatch_float(query, [&](auto tag) {
    using T = decltype(tag);
    rotary_rows<T>(positions.data_ptr<int64_t>(), data_of<T>(query), query.stride(0), query.size(1) / head_size,
                   data_of<T>(key), key.stride(0), key.size(1) / head_size, query.size(0),
                   cos_sin_cache.data_ptr<float>(), head_size, rotary_dim);
  });
}

}  // namespace raylm
