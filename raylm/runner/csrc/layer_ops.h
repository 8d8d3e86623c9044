// The decoder's elementwise steps, fused: RMSNorm (optionally with the residual add), SiLU-and-mul and
// neox rotary. One pass over memory each, threads over rows.
#pragma once

#include "vec_math.h"

namespace raylm {

// x[i] = rmsnorm(x[i] (+ residual[i])) * weight; with a residual, residual[i] becomes the sum first.
inline void rms_norm_rows(float* x, int64_t x_stride, float* residual, const float* weight, int64_t rows,
                          int64_t hidden, float eps, float* out, int64_t out_stride) {
  at::parallel_for(0, rows, rows_per_chunk(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* xi = x + i * x_stride;
      float* src = xi;
      if (residual != nullptr) {
        src = residual + i * hidden;
#pragma omp simd
        for (int64_t d = 0; d < hidden; ++d) src[d] += xi[d];
      }
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t d = 0; d < hidden; ++d) sum += src[d] * src[d];
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(hidden) + eps);
      float* oi = out + i * out_stride;
#pragma omp simd
      for (int64_t d = 0; d < hidden; ++d) oi[d] = weight[d] * (src[d] * inv);
    }
  });
}


inline torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  rms_norm_rows(x.data_ptr<float>(), x.stride(0), nullptr, weight.data_ptr<float>(), x.size(0), x.size(1),
                static_cast<float>(eps), out.data_ptr<float>(), out.stride(0));
  return out;
}

// In place, as vLLM's op: residual += x, then x = rmsnorm(residual) * weight.
inline void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes(), "residual must be contiguous, like x");
  rms_norm_rows(x.data_ptr<float>(), x.stride(0), residual.data_ptr<float>(), weight.data_ptr<float>(), x.size(0),
                x.size(1), static_cast<float>(eps), x.data_ptr<float>(), x.stride(0));
}

// [T, 2d] -> [T, d]: silu(gate) * up with gate the first half, silu(g) = g / (1 + exp(-g)).
inline torch::Tensor silu_and_mul(torch::Tensor x) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  auto out = torch::empty({rows, d}, x.options());
  const float* in = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t in_stride = x.stride(0);
  at::parallel_for(0, rows, rows_per_chunk(2 * d), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* gate = in + i * in_stride;
      const float* up = gate + d;
      float* oi = o + i * d;
      auto silu_mul = [](const float* g, const float* u, float* y) {
        const lanes_t gv = load_lanes(g);
        store_lanes(y, gv / (1.0f + vexp(-gv)) * load_lanes(u));
      };
      int64_t j = 0;
      for (; j + kLanes <= d; j += kLanes) silu_mul(gate + j, up + j, oi + j);
      if (j < d) {  // the row's last floats, through one register's worth of zero-padded floats
        float g[kLanes] = {}, u[kLanes] = {}, y[kLanes];
        std::copy(gate + j, gate + d, g);
        std::copy(up + j, up + d, u);
        silu_mul(g, u, y);
        std::copy(y, y + (d - j), oi + j);
      }
    }
  });
  return out;
}

// Neox-style rotary in place on query [T, Hq*D] and key [T, Hk*D]: within each head the first and
// second halves of the rotary dims rotate together. cos_sin_cache [max_pos, rotary_dim]: cos | sin.
inline void rotary_embedding(torch::Tensor positions, torch::Tensor query, torch::Tensor key,
                             torch::Tensor cos_sin_cache, int64_t head_size, int64_t rotary_dim) {
  check_rows(query, "query");
  check_rows(key, "key");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous(), "positions must be int64");
  TORCH_CHECK(cos_sin_cache.is_contiguous() && cos_sin_cache.size(1) == rotary_dim, "bad cos_sin_cache");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cache = cos_sin_cache.data_ptr<float>();
  const int64_t half = rotary_dim / 2, num_tokens = query.size(0);
  const int64_t q_heads = query.size(1) / head_size, k_heads = key.size(1) / head_size;
  float* q = query.data_ptr<float>();
  float* k = key.data_ptr<float>();
  const int64_t q_stride = query.stride(0), k_stride = key.stride(0);
  const int64_t grain = rows_per_chunk((q_heads + k_heads) * rotary_dim);
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = cache + pos[t] * rotary_dim;
      const float* sin = cos + half;
      for (int64_t h = 0; h < q_heads + k_heads; ++h) {
        float* x1 = h < q_heads ? q + t * q_stride + h * head_size : k + t * k_stride + (h - q_heads) * head_size;
        float* x2 = x1 + half;
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          const float a = x1[j], b = x2[j];
          x1[j] = a * cos[j] - b * sin[j];
          x2[j] = b * cos[j] + a * sin[j];
        }
      }
    }
  });
}

}  // namespace raylm
