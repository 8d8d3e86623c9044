// The KV cache write and paged causal GQA attention.
#pragma once

#include "vec_math.h"

namespace raylm {

// The cache of one layer is [2, num_blocks, Hk, block_size, D]. The value half is stored as shaped; the key
// half stores each (block, head) tile transposed, [D, block_size], so that a block's scores vectorize
// across keys (one query element times kTile consecutive keys per instruction). The block size must be a
// multiple of kTile.

// key/value [T, Hk, D] into the caches at slot_mapping[t] (-1: skip).
inline void write_kv(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache,
                     torch::Tensor value_cache, torch::Tensor slot_mapping) {
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2), "key rows must be contiguous per token");
  TORCH_CHECK(value.stride(2) == 1 && value.stride(1) == value.size(2), "value rows must be contiguous per token");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64, "slot_mapping must be int64");
  const int64_t num_tokens = key.size(0), num_kv_heads = key.size(1), head_size = key.size(2);
  const int64_t block_size = key_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float* k = key.data_ptr<float>();
  const float* v = value.data_ptr<float>();
  float* kc = key_cache.data_ptr<float>();
  float* vc = value_cache.data_ptr<float>();
  const int64_t k_stride = key.stride(0), v_stride = value.stride(0), tile = block_size * head_size;
  at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const float* kt = k + t * k_stride + h * head_size;
        float* k_tile = kc + (block * num_kv_heads + h) * tile + offset;
        for (int64_t d = 0; d < head_size; ++d) k_tile[d * block_size] = kt[d];
        std::memcpy(vc + (block * num_kv_heads + h) * tile + offset * head_size, v + t * v_stride + h * head_size,
                    head_size * sizeof(float));
      }
    }
  });
}

// Online-softmax state of one query row: running max and running sum of exp(score - max).
struct RowState {
  float max = -INFINITY;
  float sum = 0.0f;
};

// Scores of one query row against the kTile keys of a transposed key tile (row stride block_size).
inline vec16 tile_scores(const float* q, const float* k_tile, int64_t head_size, int64_t block_size) {
  vec16 c0 = {}, c1 = {}, c2 = {}, c3 = {};  // four chains so that consecutive FMAs do not wait on each other
  int64_t d = 0;
  for (; d + 3 < head_size; d += 4) {
    const float* k = k_tile + d * block_size;
    c0 += q[d] * load16(k);
    c1 += q[d + 1] * load16(k + block_size);
    c2 += q[d + 2] * load16(k + 2 * block_size);
    c3 += q[d + 3] * load16(k + 3 * block_size);
  }
  for (; d < head_size; ++d) c0 += q[d] * load16(k_tile + d * block_size);
  return (c0 + c1) + (c2 + c3);
}

// Asks for a key tile (head_size rows of kTile keys) and a value tile (kTile rows of head_size) to come into L2.
// L2, not L1 (locality 1, prefetcht2): a burst of 2 x head_size line requests into L1 overflows its few miss
// buffers, and decode batches read the tiles from DRAM (1.4x faster decode attention than prefetcht0 measured).
inline void prefetch_tile(const float* k_tile, int64_t head_size, int64_t block_size, const float* v_tile) {
  for (int64_t d = 0; d < head_size; ++d) __builtin_prefetch(k_tile + d * block_size, 0, 1);
  for (int64_t i = 0; i < kTile * head_size; i += kTile) __builtin_prefetch(v_tile + i, 0, 1);
}

// max(s[0:n]) for 1 <= n <= kTile, as a tree rather than a chain of dependent compares.
inline float tile_max(const float* s, int64_t n) {
  float m[kTile];
  for (int64_t j = 0; j < kTile; ++j) m[j] = j < n ? s[j] : s[0];
  for (int64_t width = kTile / 2; width > 0; width /= 2)
    for (int64_t j = 0; j < width; ++j) m[j] = std::max(m[j], m[j + width]);
  return m[0];
}

// acc[0:head_size] += sum over the tile's first `visible` keys of p[j] * v_tile[j].
inline void accumulate_values(float* acc, const float* p, const float* v_tile, int64_t visible, int64_t head_size) {
  int64_t d = 0;
  for (; d + kTile <= head_size; d += kTile) {
    vec16 even = load16(acc + d), odd = {};
    int64_t j = 0;
    for (; j + 1 < visible; j += 2) {
      even += p[j] * load16(v_tile + j * head_size + d);
      odd += p[j + 1] * load16(v_tile + (j + 1) * head_size + d);
    }
    if (j < visible) even += p[j] * load16(v_tile + j * head_size + d);
    store16(acc + d, even + odd);
  }
  for (; d < head_size; ++d)
    for (int64_t j = 0; j < visible; ++j) acc[d] += p[j] * v_tile[j * head_size + d];
}


// Causal GQA attention of every request's queries over its paged K/V (already written, new tokens included).
// Request r owns query rows query_start_loc[r]..[r+1], the last tokens of its seq_lens[r] tokens.
// One task is (request, KV head, chunk of query tokens): its G = Hq/Hk query heads share each K/V tile
// read, and an online softmax visits every visible cached key once. Writes out[t, h, :].
inline void paged_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                            torch::Tensor value_cache, torch::Tensor block_table, torch::Tensor seq_lens,
                            torch::Tensor query_start_loc, double scale) {
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2), "query heads must be contiguous per token");
  TORCH_CHECK(out.stride(2) == 1 && out.stride(1) == out.size(2), "out heads must be contiguous per token");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32 &&
                  query_start_loc.scalar_type() == torch::kInt32,
              "block_table, seq_lens and query_start_loc must be int32");
  const int64_t num_heads = query.size(1), head_size = query.size(2);
  const int64_t num_kv_heads = key_cache.size(1), block_size = key_cache.size(2);
  TORCH_CHECK(block_size % kTile == 0, "block_size must be a multiple of ", kTile);
  const int64_t group = num_heads / num_kv_heads, q_stride = query.stride(0), out_stride = out.stride(0);
  const int64_t bt_stride = block_table.stride(0), tile = block_size * head_size;
  constexpr int64_t kChunk = 16;  // query tokens per task: long chunks split across threads

  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  struct Chunk { int32_t req; int32_t first; int32_t count; };
  std::vector<Chunk> chunks;
  for (int32_t r = 0; r < seq_lens.size(0); ++r) {
    const int32_t query_len = qsl[r + 1] - qsl[r];
    for (int32_t first = 0; first < query_len; first += kChunk)
      chunks.push_back({r, first, std::min<int32_t>(kChunk, query_len - first)});
  }
  const float* q_base = query.data_ptr<float>();
  const float* kc = key_cache.data_ptr<float>();
  const float* vc = value_cache.data_ptr<float>();
  float* o_base = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, static_cast<int64_t>(chunks.size()) * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q_rows, acc;
    std::vector<RowState> state;
    for (int64_t task = begin; task < end; ++task) {
      const Chunk c = chunks[task / num_kv_heads];
      const int64_t kv_head = task % num_kv_heads, rows = c.count * group;
      const int64_t first_pos = lens[c.req] - (qsl[c.req + 1] - qsl[c.req]) + c.first;  // of the first query
      q_rows.resize(rows * head_size);
      acc.assign(rows * head_size, 0.0f);
      state.assign(rows, RowState{});
      for (int64_t row = 0; row < rows; ++row) {
        const int64_t token = qsl[c.req] + c.first + row / group, head = kv_head * group + row % group;
        const float* src = q_base + token * q_stride + head * head_size;
        float* dst = q_rows.data() + row * head_size;
#pragma omp simd
        for (int64_t d = 0; d < head_size; ++d) dst[d] = src[d] * fscale;
      }
      const int64_t num_keys = first_pos + c.count;  // keys the chunk's last query sees
      const int32_t* blocks = table + c.req * bt_stride;
      for (int64_t start = 0; start < num_keys; start += kTile) {
        const int64_t block = blocks[start / block_size], offset = start % block_size;
        const float* k_tile = kc + (block * num_kv_heads + kv_head) * tile + offset;
        const float* v_tile = vc + (block * num_kv_heads + kv_head) * tile + offset * head_size;
        const int64_t next = start + kTile;
        if (next < num_keys) {
          // Blocks lie anywhere in the pool, beyond the hardware prefetcher's reach: ask for the next tile now.
          const int64_t next_block = blocks[next / block_size], next_offset = next % block_size;
          prefetch_tile(kc + (next_block * num_kv_heads + kv_head) * tile + next_offset, head_size, block_size,
                        vc + (next_block * num_kv_heads + kv_head) * tile + next_offset * head_size);
        }
        for (int64_t row = 0; row < rows; ++row) {
          const int64_t visible = std::min(kTile, first_pos + row / group + 1 - start);  // causal limit
          if (visible <= 0) continue;
          const vec16 scores = tile_scores(q_rows.data() + row * head_size, k_tile, head_size, block_size);
          float s[kTile];
          store16(s, scores);
          RowState& st = state[row];
          const float new_max = std::max(st.max, tile_max(s, visible));
          const float correction = vexp(st.max - new_max);
          float tile_sum = 0.0f;
#pragma omp simd reduction(+ : tile_sum)
          for (int64_t j = 0; j < kTile; ++j) {
            s[j] = j < visible ? vexp(s[j] - new_max) : 0.0f;
            tile_sum += s[j];
          }
          st.max = new_max;
          st.sum = st.sum * correction + tile_sum;
          float* a = acc.data() + row * head_size;
          if (correction != 1.0f) {
#pragma omp simd
            for (int64_t d = 0; d < head_size; ++d) a[d] *= correction;
          }
          accumulate_values(a, s, v_tile, visible, head_size);
        }
      }
      for (int64_t row = 0; row < rows; ++row) {
        const int64_t token = qsl[c.req] + c.first + row / group, head = kv_head * group + row % group;
        float* dst = o_base + token * out_stride + head * head_size;
        const float* a = acc.data() + row * head_size;
        const float inv = 1.0f / state[row].sum;
#pragma omp simd
        for (int64_t d = 0; d < head_size; ++d) dst[d] = a[d] * inv;
      }
    }
  });
}

}  // namespace raylm
