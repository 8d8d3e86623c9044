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
  const int64_t grain = rows_per_chunk(2 * num_kv_heads * head_size);
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
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

// Query rows of one task that share each K/V tile read: R rows' scores come from one pass over the key tile and
// their values from one pass over the value tile, so every vector load feeds R FMAs instead of one.
constexpr int64_t kRowBlock = 4;

// scores[r] = the kTile scores of query row r (of R, rows head_size apart) against a transposed key tile.
template <int R>
inline void block_scores(const float* q, const float* k_tile, int64_t head_size, int64_t block_size, vec16* scores) {
  vec16 even[R] = {}, odd[R] = {};  // two chains per row, so that consecutive FMAs do not wait on each other
  int64_t d = 0;
  for (; d + 1 < head_size; d += 2) {
    const vec16 k0 = load16(k_tile + d * block_size), k1 = load16(k_tile + (d + 1) * block_size);
    for (int r = 0; r < R; ++r) {
      even[r] += q[r * head_size + d] * k0;
      odd[r] += q[r * head_size + d + 1] * k1;
    }
  }
  if (d < head_size) {
    const vec16 k0 = load16(k_tile + d * block_size);
    for (int r = 0; r < R; ++r) even[r] += q[r * head_size + d] * k0;
  }
  for (int r = 0; r < R; ++r) scores[r] = even[r] + odd[r];
}

// Loads a key tile (head_size rows of kTile keys) and a value tile (kTile rows of head_size) into L2, not L1
// (locality 1, prefetcht2): a burst of 2 x head_size line requests into L1 overflows its few miss buffers, and
// decode batches read the tiles from DRAM (1.4x faster decode attention than prefetcht0 measured).
inline void prefetch_tile(const float* k_tile, int64_t head_size, int64_t block_size, const float* v_tile) {
  for (int64_t d = 0; d < head_size; ++d) __builtin_prefetch(k_tile + d * block_size, 0, 1);
  for (int64_t i = 0; i < kTile * head_size; i += kTile) __builtin_prefetch(v_tile + i, 0, 1);
}

// acc[r][0:head_size] += sum over the tile's first `visible` keys of p[r][j] * v_tile[j], for R rows (p is zero
// past each row's own causal limit).
template <int R>
inline void block_accumulate(float* acc, const float (*p)[kTile], const float* v_tile, int64_t visible,
                             int64_t head_size) {
  int64_t d = 0;
  for (; d + kTile <= head_size; d += kTile) {
    vec16 even[R], odd[R];
    for (int r = 0; r < R; ++r) {
      even[r] = load16(acc + r * head_size + d);
      odd[r] = vec16{};
    }
    int64_t j = 0;
    for (; j + 1 < visible; j += 2) {
      const vec16 v0 = load16(v_tile + j * head_size + d), v1 = load16(v_tile + (j + 1) * head_size + d);
      for (int r = 0; r < R; ++r) {
        even[r] += p[r][j] * v0;
        odd[r] += p[r][j + 1] * v1;
      }
    }
    if (j < visible) {
      const vec16 v0 = load16(v_tile + j * head_size + d);
      for (int r = 0; r < R; ++r) even[r] += p[r][j] * v0;
    }
    for (int r = 0; r < R; ++r) store16(acc + r * head_size + d, even[r] + odd[r]);
  }
  for (; d < head_size; ++d)
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < visible; ++j) acc[r * head_size + d] += p[r][j] * v_tile[j * head_size + d];
}

// One row block's online-softmax step over one tile, the r-th row seeing visible[r] of its keys. Each row's
// step is whole-vector work on its 16 scores (masked lanes, shuffle reductions): 1.3-1.45x faster prefill
// attention than the former per-lane loops.
template <int R>
inline void attend_tile(const float* q_rows, float* acc, RowState* state, const float* k_tile, const float* v_tile,
                        const int64_t* visible, int64_t head_size, int64_t block_size) {
  vec16 scores[R];
  block_scores<R>(q_rows, k_tile, head_size, block_size, scores);
  float p[R][kTile];
  int64_t max_visible = 0;
  for (int r = 0; r < R; ++r) {
    const int64_t n = visible[r];
    max_visible = std::max(max_visible, n);
    if (n <= 0) {  // this row's causal limit ends before the tile
      store16(p[r], vec16{});
      continue;
    }
    const ivec16 in_view = kLanes < static_cast<int32_t>(n);
    const vec16 s = in_view ? scores[r] : vec16{} - INFINITY;
    RowState& st = state[r];
    const float new_max = std::max(st.max, hmax16(s));
    const float correction = vexp(st.max - new_max);
    vec16 e = vexp16(s - new_max);
    e = in_view ? e : vec16{};
    store16(p[r], e);
    st.max = new_max;
    st.sum = st.sum * correction + hsum16(e);
    if (correction != 1.0f) {
      float* a = acc + r * head_size;
#pragma omp simd
      for (int64_t d = 0; d < head_size; ++d) a[d] *= correction;
    }
  }
  block_accumulate<R>(acc, p, v_tile, max_visible, head_size);
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
        for (int64_t row0 = 0; row0 < rows; row0 += kRowBlock) {
          const int64_t block_rows = std::min(kRowBlock, rows - row0);
          int64_t visible[kRowBlock];
          for (int64_t r = 0; r < block_rows; ++r)
            visible[r] = std::min(kTile, first_pos + (row0 + r) / group + 1 - start);  // causal limit
          if (visible[block_rows - 1] <= 0) continue;  // no row of the block sees this tile (later rows may)
          const float* q = q_rows.data() + row0 * head_size;
          float* a = acc.data() + row0 * head_size;
          RowState* st = state.data() + row0;
          switch (block_rows) {
            case 4: attend_tile<4>(q, a, st, k_tile, v_tile, visible, head_size, block_size); break;
            case 3: attend_tile<3>(q, a, st, k_tile, v_tile, visible, head_size, block_size); break;
            case 2: attend_tile<2>(q, a, st, k_tile, v_tile, visible, head_size, block_size); break;
            default: attend_tile<1>(q, a, st, k_tile, v_tile, visible, head_size, block_size); break;
          }
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
