// The KV cache write: a step's new keys and values into their slots.
#pragma once

#include "vec_math.h"

namespace raylm {

// The cache of one layer is [2, num_blocks, Hk, block_size, D]. The value half is stored as shaped; the key
// half stores each (block, head) tile transposed, [D, block_size], so that a block's scores vectorize
// across keys (one query element times kTile consecutive keys per instruction). The block size must be a
// multiple of kTile.
constexpr int64_t kTile = kLanes;  // keys per tile: one register of scores

template <typename T>
void write_kv_rows(const T* k, int64_t k_stride, const T* v, int64_t v_stride, T* kc, T* vc, const int64_t* slots,
                   int64_t num_tokens, int64_t num_kv_heads, int64_t head_size, int64_t block_size) {
  const int64_t tile = block_size * head_size;
  // Each token's key column touches head_size lines of its tiles, which a decode step finds in memory, not cache:
  // threads split the tokens by lines written, and the next token's lines are requested while this one's are written.
  const int64_t lines_per_token = num_kv_heads * (head_size + head_size / kLineElements<T>);  // key columns, value rows
  const int64_t grain = std::max<int64_t>(1, 256 / lines_per_token);
  auto tile_offset = [&](int64_t slot, int64_t h) { return (slot / block_size * num_kv_heads + h) * tile; };
  auto prefetch_token = [&](int64_t t) {
    if (slots[t] < 0) return;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const T* k_tile = kc + tile_offset(slots[t], h) + slots[t] % block_size;
      for (int64_t d = 0; d < head_size; ++d) __builtin_prefetch(k_tile + d * block_size, 1, 3);
    }
  };
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (t + 1 < end) prefetch_token(t + 1);
      if (slots[t] < 0) continue;
      const int64_t offset = slots[t] % block_size;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const T* kt = k + t * k_stride + h * head_size;
        T* k_tile = kc + tile_offset(slots[t], h) + offset;
        for (int64_t d = 0; d < head_size; ++d) k_tile[d * block_size] = kt[d];
        std::memcpy(vc + tile_offset(slots[t], h) + offset * head_size, v + t * v_stride + h * head_size,
                    head_size * sizeof(T));
      }
    }
  });
}

// key/value [T, Hk, D] into the caches (of their dtype, float32 or bfloat16) at slot_mapping[t] (-1: skip).
inline void write_kv(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache,
                     torch::Tensor value_cache, torch::Tensor slot_mapping) {
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2), "key rows must be contiguous per token");
  TORCH_CHECK(value.stride(2) == 1 && value.stride(1) == value.size(2), "value rows must be contiguous per token");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64, "slot_mapping must be int64");
  check_same_dtype(value, key, "value");
  check_same_dtype(key_cache, key, "key_cache");
  check_same_dtype(value_cache, key, "value_cache");
  dispatch_float(key, [&](auto tag) {
    using T = decltype(tag);
    write_kv_rows<T>(data_of<T>(key), key.stride(0), data_of<T>(value), value.stride(0), data_of<T>(key_cache),
                     data_of<T>(value_cache), slot_mapping.data_ptr<int64_t>(), key.size(0), key.size(1), key.size(2),
                     key_cache.size(2));
  });
}

}  // namespace raylm
