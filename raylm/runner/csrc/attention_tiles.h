// The tile-level steps of paged attention (paged_attention.h): a row block's scores against one key tile, where
// a request's key and value tiles lie in the paged cache (and asking for them ahead), and a row block's weighted
// sum of value rows.
#pragma once

#include "kv_cache_write.h"

namespace raylm {

// Query rows of one task that share each key tile read: R rows' scores come from one pass over the key tile and
// their weighted values from one pass over the value rows, so every vector load feeds R FMAs instead of one.
// AVX-512's 32 registers hold 8 rows' two accumulator chains; AVX2's 16 hold 4.
constexpr int64_t kRowBlock = kLanes == 16 ? 8 : 4;

// f(std::integral_constant<int, n>{}) for a run-time n in [1, N]: the row-block kernels take R as a template argument.
template <int N, typename F>
inline void with_rows(int64_t n, F&& f) {
  if constexpr (N > 1) {
    if (n < N) return with_rows<N - 1>(n, f);
  }
  f(std::integral_constant<int, N>{});
}
// How many tiles ahead of the one being read a task asks for the next ones.
constexpr int64_t kTilesAhead = 2;

// A line of a tile further ahead into L2, not L1 (locality 1, prefetcht2): decode batches read the tiles from DRAM,
// and L1's few miss buffers would hold up the loads of the tile being read (1.4x faster than prefetcht0 measured).
inline void prefetch_line(const void* line) { __builtin_prefetch(line, 0, 1); }

// scores[r] = the kTile scores of query row r (of R, rows head_size apart) against a transposed key tile. Each line
// read asks for the same line of `ahead_tile` (unless null): one request per load spreads the next tile's misses over
// the work, where a burst of a whole tile's requests stalled the loads behind it (decode from DRAM 1.16-1.28x faster).
template <int R, typename T>
inline void block_scores(const float* q, const T* k_tile, int64_t head_size, int64_t block_size, lanes_t* scores,
                         const T* ahead_tile) {
  lanes_t even[R] = {}, odd[R] = {};  // two chains per row, so that consecutive FMAs do not wait on each other
  int64_t d = 0;
  for (; d + 1 < head_size; d += 2) {
    if (ahead_tile != nullptr) {
      prefetch_line(ahead_tile + d * block_size);
      prefetch_line(ahead_tile + (d + 1) * block_size);
    }
    const lanes_t k0 = load_lanes(k_tile + d * block_size), k1 = load_lanes(k_tile + (d + 1) * block_size);
    for (int r = 0; r < R; ++r) {
      even[r] += q[r * head_size + d] * k0;
      odd[r] += q[r * head_size + d + 1] * k1;
    }
  }
  if (d < head_size) {
    if (ahead_tile != nullptr) prefetch_line(ahead_tile + d * block_size);
    const lanes_t k0 = load_lanes(k_tile + d * block_size);
    for (int r = 0; r < R; ++r) even[r] += q[r * head_size + d] * k0;
  }
  for (int r = 0; r < R; ++r) scores[r] = even[r] + odd[r];
}

// Where the key and value tiles of one request's KV head lie: `start` is a key position, a multiple of kTile.
template <typename T>
struct KvTiles {
  const T* key_cache;
  const T* value_cache;
  const int32_t* blocks;  // the request's block table row
  int64_t kv_head, num_kv_heads, head_size, block_size;

  int64_t tile_offset(int64_t start) const {
    return (blocks[start / block_size] * num_kv_heads + kv_head) * block_size * head_size;
  }
  const T* key(int64_t start) const { return key_cache + tile_offset(start) + start % block_size; }
  const T* value(int64_t start) const { return value_cache + tile_offset(start) + start % block_size * head_size; }

  // The key or value tile kTilesAhead after the one at `start`, or null past the `num_keys` read.
  const T* key_ahead(int64_t start, int64_t num_keys) const {
    return start + kTilesAhead * kTile < num_keys ? key(start + kTilesAhead * kTile) : nullptr;
  }
  const T* value_ahead(int64_t start, int64_t num_keys) const {
    return start + kTilesAhead * kTile < num_keys ? value(start + kTilesAhead * kTile) : nullptr;
  }
  // Row j (one key's head_size elements) of a value tile.
  void prefetch_value_row(const T* v_tile, int64_t j) const {
    for (int64_t i = 0; i < head_size; i += kLineElements<T>) prefetch_line(v_tile + j * head_size + i);
  }

  // Every line of the first kTilesAhead key tiles, or value tiles, of keys [key0, num_keys) (a task asks at once
  // what it reads first; later tiles it asks for line by line as it reads).
  void prefetch_first_keys(int64_t key0, int64_t num_keys) const {
    for (int64_t start = key0; start < std::min(key0 + kTilesAhead * kTile, num_keys); start += kTile)
      for (int64_t d = 0; d < head_size; ++d) prefetch_line(key(start) + d * block_size);
  }
  void prefetch_first_values(int64_t key0, int64_t num_keys) const {
    for (int64_t start = key0; start < std::min(key0 + kTilesAhead * kTile, num_keys); start += kTile)
      for (int64_t j = 0; j < kTile; ++j) prefetch_value_row(value(start), j);
  }
};

// Scores of R rows against one key tile, stored at scores[r * stride].
template <int R, typename T>
inline void store_scores(const float* q, const T* k_tile, int64_t head_size, int64_t block_size, float* scores,
                         int64_t stride, const T* ahead_tile) {
  lanes_t s[R];
  block_scores<R, T>(q, k_tile, head_size, block_size, s, ahead_tile);
  for (int r = 0; r < R; ++r) store_lanes(scores + r * stride, s[r]);
}

// Vectors of the head per value slab for R rows: the most, up to 4, whose R x slab accumulators fit in 16 of
// AVX-512's 32 registers or 12 of AVX2's 16 (beside the slab's loads and a broadcast). AVX2 at 12, against 8 or 16:
// decode 1.10x and 1.00x faster, prefill 1.01x and 1.20x.
constexpr int64_t kAccumulatorRegisters = kLanes == 16 ? 16 : 12;
constexpr int64_t slab_vectors(int64_t rows) {
  int64_t slab = 4;
  while (slab > 1 && rows * slab > kAccumulatorRegisters) slab /= 2;
  return slab;
}

// acc[r][:] = sum over keys [key0, num_keys) of p[r * p_stride + key - key0] * value[key], for R rows (key0 a
// multiple of kTile). Each slab of kSlab vectors of the head keeps its R x kSlab accumulators in registers across
// every key. The first slab of the first row block (`prefetch`) asks for the value tile kTilesAhead ahead, one row
// per row read.
template <int R, typename T>
inline void accumulate_values(float* acc, const float* p, int64_t p_stride, const KvTiles<T>& tiles, int64_t key0,
                              int64_t num_keys, bool prefetch) {
  constexpr int64_t kSlab = slab_vectors(R);
  const int64_t head_size = tiles.head_size;
  int64_t d0 = 0;
  for (; d0 + kSlab * kLanes <= head_size; d0 += kSlab * kLanes) {
    lanes_t a[R][kSlab] = {};
    for (int64_t start = key0; start < num_keys; start += kTile) {
      const T* v = tiles.value(start) + d0;
      const T* ahead_tile = prefetch && d0 == 0 ? tiles.value_ahead(start, num_keys) : nullptr;
      const int64_t visible = std::min(kTile, num_keys - start);
      for (int64_t j = 0; j < visible; ++j, v += head_size) {
        if (ahead_tile != nullptr) tiles.prefetch_value_row(ahead_tile, j);
        lanes_t vs[kSlab];
        for (int c = 0; c < kSlab; ++c) vs[c] = load_lanes(v + c * kLanes);
        for (int r = 0; r < R; ++r) {
          const float pr = p[r * p_stride + start - key0 + j];
          for (int c = 0; c < kSlab; ++c) a[r][c] += pr * vs[c];
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kSlab; ++c) store_lanes(acc + r * head_size + d0 + c * kLanes, a[r][c]);
  }
  if (d0 == head_size) return;
  for (int r = 0; r < R; ++r) std::fill(acc + r * head_size + d0, acc + (r + 1) * head_size, 0.0f);
  for (int64_t start = key0; start < num_keys; start += kTile) {
    const T* v_tile = tiles.value(start);
    // Heads under 64 floats run only this loop: it asks for the tile ahead in their place.
    const T* ahead_tile = prefetch && d0 == 0 ? tiles.value_ahead(start, num_keys) : nullptr;
    for (int64_t j = 0; j < std::min(kTile, num_keys - start); ++j) {
      if (ahead_tile != nullptr) tiles.prefetch_value_row(ahead_tile, j);
      for (int r = 0; r < R; ++r) {
        const float pr = p[r * p_stride + start - key0 + j];
        float* a = acc + r * head_size;
#pragma omp simd
        for (int64_t d = d0; d < head_size; ++d) a[d] += pr * to_float(v_tile[j * head_size + d]);
      }
    }
  }
}

}  // namespace raylm
