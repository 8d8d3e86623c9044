// Paged causal GQA attention over the KV cache that kv_cache_write.h fills: float32 or bfloat16 queries, cache and
// output, float32 scores, softmax and sums (a bfloat16 key or value row widens to float32 as it is loaded).
#pragma once

#include "kv_cache_write.h"

namespace raylm {

// Query rows of one task that share each key tile read: R rows' scores come from one pass over the key tile and
// their weighted values from one pass over the value rows, so every vector load feeds R FMAs instead of one.
constexpr int64_t kRowBlock = 4;
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

  // Every line of the first kTilesAhead key tiles, or value tiles, of `num_keys` (a task asks at once what it reads
  // first; later tiles it asks for line by line as it reads).
  void prefetch_first_keys(int64_t num_keys) const {
    for (int64_t start = 0; start < std::min(kTilesAhead * kTile, num_keys); start += kTile)
      for (int64_t d = 0; d < head_size; ++d) prefetch_line(key(start) + d * block_size);
  }
  void prefetch_first_values(int64_t num_keys) const {
    for (int64_t start = 0; start < std::min(kTilesAhead * kTile, num_keys); start += kTile)
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

// scores[0:n) = exp(scores - their max) in place, zero from n up to `stride` (a multiple of kTile); returns their sum.
inline float softmax_row(float* scores, int64_t n, int64_t stride) {
  const int64_t last = (n - 1) / kTile * kTile;  // the vector holding the row's last key
  const int_lanes_t in_view = lane_index() < static_cast<int32_t>(n - last);
  lanes_t max = in_view ? load_lanes(scores + last) : broadcast(-INFINITY);
  for (int64_t i = 0; i < last; i += kTile) max = vmax(max, load_lanes(scores + i));
  const float row_max = hmax(max);
  lanes_t sum = {};
  for (int64_t i = 0; i <= last; i += kTile) {
    lanes_t e = vexp(load_lanes(scores + i) - row_max);
    if (i == last) e = in_view ? e : lanes_t{};
    store_lanes(scores + i, e);
    sum += e;
  }
  std::fill(scores + last + kTile, scores + stride, 0.0f);
  return hsum(sum);
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

// acc[r][:] = sum over the first num_keys keys of p[r * p_stride + key] * value[key], for R rows. Each slab of
// kSlab vectors of the head keeps its R x kSlab accumulators in registers across every key. The first slab of the
// first row block (`prefetch`) asks for the value tile kTilesAhead ahead, one row per row read.
template <int R, typename T>
inline void accumulate_values(float* acc, const float* p, int64_t p_stride, const KvTiles<T>& tiles, int64_t num_keys,
                              bool prefetch) {
  constexpr int64_t kSlab = slab_vectors(R);
  const int64_t head_size = tiles.head_size;
  int64_t d0 = 0;
  for (; d0 + kSlab * kLanes <= head_size; d0 += kSlab * kLanes) {
    lanes_t a[R][kSlab] = {};
    for (int64_t start = 0; start < num_keys; start += kTile) {
      const T* v = tiles.value(start) + d0;
      const T* ahead_tile = prefetch && d0 == 0 ? tiles.value_ahead(start, num_keys) : nullptr;
      const int64_t visible = std::min(kTile, num_keys - start);
      for (int64_t j = 0; j < visible; ++j, v += head_size) {
        if (ahead_tile != nullptr) tiles.prefetch_value_row(ahead_tile, j);
        lanes_t vs[kSlab];
        for (int c = 0; c < kSlab; ++c) vs[c] = load_lanes(v + c * kLanes);
        for (int r = 0; r < R; ++r) {
          const float pr = p[r * p_stride + start + j];
          for (int c = 0; c < kSlab; ++c) a[r][c] += pr * vs[c];
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kSlab; ++c) store_lanes(acc + r * head_size + d0 + c * kLanes, a[r][c]);
  }
  if (d0 == head_size) return;
  for (int r = 0; r < R; ++r) std::fill(acc + r * head_size + d0, acc + (r + 1) * head_size, 0.0f);
  for (int64_t start = 0; start < num_keys; start += kTile) {
    const T* v_tile = tiles.value(start);
    // Heads under 64 floats run only this loop: it asks for the tile ahead in their place.
    const T* ahead_tile = prefetch && d0 == 0 ? tiles.value_ahead(start, num_keys) : nullptr;
    for (int64_t j = 0; j < std::min(kTile, num_keys - start); ++j) {
      if (ahead_tile != nullptr) tiles.prefetch_value_row(ahead_tile, j);
      for (int r = 0; r < R; ++r) {
        const float pr = p[r * p_stride + start + j];
        float* a = acc + r * head_size;
#pragma omp simd
        for (int64_t d = d0; d < head_size; ++d) a[d] += pr * to_float(v_tile[j * head_size + d]);
      }
    }
  }
}

// One task's rows over their causal keys: row r (query token r / group of the task, one of its KV head's group
// query heads) sees keys [0, first_pos + r / group + 1). Two passes: every row's scores first (a row block shares
// each key tile), then one softmax per row over whole vectors, then the values, weighted, from the same tiles. Unlike
// an online softmax, no running max, sum and rescale per tile, which cost more than the dot products when a task
// has a handful of rows (a decode's G heads). Writes each row's normalized output to out_rows[r].
template <typename T>
void attend_rows(const float* q_rows, int64_t rows, int64_t group, int64_t first_pos, const KvTiles<T>& tiles,
                 std::vector<float>& scores, float* acc, T* const* out_rows) {
  const int64_t head_size = tiles.head_size, block_size = tiles.block_size;
  const int64_t num_keys = first_pos + (rows - 1) / group + 1;  // keys the last row sees
  const int64_t stride = (num_keys + kTile - 1) / kTile * kTile;
  auto block_keys = [&](int64_t row0) {  // keys the last row of the block at row0 sees
    return first_pos + (std::min(row0 + kRowBlock, rows) - 1) / group + 1;
  };
  scores.resize(rows * stride);
  // Blocks lie anywhere in the pool, beyond the hardware prefetcher's reach: the kernel asks for each tile ahead.
  tiles.prefetch_first_keys(num_keys);
  for (int64_t start = 0; start < num_keys; start += kTile) {
    const T* ahead_tile = tiles.key_ahead(start, num_keys);
    const T* k_tile = tiles.key(start);
    for (int64_t row0 = 0; row0 < rows; row0 += kRowBlock) {
      if (start >= block_keys(row0)) continue;  // beyond every causal limit of this block (later blocks see more)
      const float* q = q_rows + row0 * head_size;
      float* s = scores.data() + row0 * stride + start;
      const T* ask = row0 == 0 ? ahead_tile : nullptr;  // the first row block asks for the tile ahead
      switch (std::min(kRowBlock, rows - row0)) {
        case 4: store_scores<4, T>(q, k_tile, head_size, block_size, s, stride, ask); break;
        case 3: store_scores<3, T>(q, k_tile, head_size, block_size, s, stride, ask); break;
        case 2: store_scores<2, T>(q, k_tile, head_size, block_size, s, stride, ask); break;
        default: store_scores<1, T>(q, k_tile, head_size, block_size, s, stride, ask); break;
      }
    }
  }
  tiles.prefetch_first_values(num_keys);
  for (int64_t row0 = 0; row0 < rows; row0 += kRowBlock) {
    const int64_t block_rows = std::min(kRowBlock, rows - row0), keys = block_keys(row0);
    const int64_t block_stride = (keys + kTile - 1) / kTile * kTile;
    float sums[kRowBlock];
    for (int64_t r = 0; r < block_rows; ++r) {
      const int64_t row = row0 + r;
      sums[r] = softmax_row(scores.data() + row * stride, first_pos + row / group + 1, block_stride);
    }
    const float* p = scores.data() + row0 * stride;
    switch (block_rows) {
      case 4: accumulate_values<4, T>(acc, p, stride, tiles, keys, row0 == 0); break;
      case 3: accumulate_values<3, T>(acc, p, stride, tiles, keys, row0 == 0); break;
      case 2: accumulate_values<2, T>(acc, p, stride, tiles, keys, row0 == 0); break;
      default: accumulate_values<1, T>(acc, p, stride, tiles, keys, row0 == 0); break;
    }
    for (int64_t r = 0; r < block_rows; ++r) {
      const float inv = 1.0f / sums[r];
      const float* a = acc + r * head_size;
      T* dst = out_rows[row0 + r];
#pragma omp simd
      for (int64_t d = 0; d < head_size; ++d) dst[d] = from_float<T>(a[d] * inv);
    }
  }
}

// Causal GQA attention of every request's queries over its paged K/V (already written, new tokens included).
// Request r owns query rows query_start_loc[r]..[r+1], the last tokens of its seq_lens[r] tokens.
// One task is (request, KV head, chunk of query tokens): its G = Hq/Hk query heads share each K/V tile
// read, and every visible cached key is scored once and weighted once (attend_rows). Writes out[t, h, :].
inline void paged_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                            torch::Tensor value_cache, torch::Tensor block_table, torch::Tensor seq_lens,
                            torch::Tensor query_start_loc, double scale) {
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2), "query heads must be contiguous per token");
  TORCH_CHECK(out.stride(2) == 1 && out.stride(1) == out.size(2), "out heads must be contiguous per token");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  check_same_dtype(out, query, "out");
  check_same_dtype(key_cache, query, "key_cache");
  check_same_dtype(value_cache, query, "value_cache");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32 &&
                  query_start_loc.scalar_type() == torch::kInt32,
              "block_table, seq_lens and query_start_loc must be int32");
  const int64_t num_heads = query.size(1), head_size = query.size(2);
  const int64_t num_kv_heads = key_cache.size(1), block_size = key_cache.size(2);
  TORCH_CHECK(block_size % kTile == 0, "block_size must be a multiple of ", kTile);
  const int64_t group = num_heads / num_kv_heads, q_stride = query.stride(0), out_stride = out.stride(0);
  const int64_t bt_stride = block_table.stride(0);
  // Query tokens per task: long prompts split across threads, and fewer tokens where a task's scores (tokens x
  // group x keys floats) would outgrow L2 (long contexts).
  constexpr int64_t kChunk = 16, kScoresBytes = 512 * 1024;

  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  // A chunk: `count` query tokens of request `req`, the first at row `token` of the batch and position `first_pos`.
  struct Chunk { int32_t req; int32_t token; int32_t first_pos; int32_t count; };
  std::vector<Chunk> chunks;
  for (int32_t r = 0; r < seq_lens.size(0); ++r) {
    const int32_t query_len = qsl[r + 1] - qsl[r], context_len = lens[r] - query_len;
    const auto chunk = static_cast<int32_t>(
        std::clamp<int64_t>(kScoresBytes / (group * std::max(lens[r], 1) * sizeof(float)), 1, kChunk));
    for (int32_t first = 0; first < query_len; first += chunk)
      chunks.push_back({r, qsl[r] + first, context_len + first, std::min<int32_t>(chunk, query_len - first)});
  }
  const float fscale = static_cast<float>(scale);

  // Each thread takes a run of tasks of about equal work (query tokens x keys seen), not of equal count: requests
  // differ in length, and the thread with the most work sets the step's pace.
  const int64_t num_tasks = static_cast<int64_t>(chunks.size()) * num_kv_heads;
  std::vector<int64_t> work_before(num_tasks + 1, 0);
  for (int64_t task = 0; task < num_tasks; ++task) {
    const Chunk c = chunks[task / num_kv_heads];
    work_before[task + 1] = work_before[task] + int64_t{c.count} * (c.first_pos + c.count);  // x the last query's keys
  }
  auto first_task = [&](int64_t share, int64_t shares) {  // where the share-th of `shares` equal parts of work starts
    return std::lower_bound(work_before.begin(), work_before.end(), work_before.back() * share / shares) -
           work_before.begin();
  };
  const int64_t shares = std::min<int64_t>(at::get_num_threads(), num_tasks);
  dispatch_float(query, [&](auto tag) {
    using T = decltype(tag);
    const T* q_base = data_of<T>(query);
    const T* kc = data_of<T>(key_cache);
    const T* vc = data_of<T>(value_cache);
    T* o_base = data_of<T>(out);
    at::parallel_for(0, shares, 1, [&](int64_t share_begin, int64_t share_end) {
      std::vector<float> q_rows, acc(kRowBlock * head_size), scores;
      std::vector<T*> out_rows;
      const int64_t end = share_end == shares ? num_tasks : first_task(share_end, shares);
      for (int64_t task = first_task(share_begin, shares); task < end; ++task) {
        const Chunk c = chunks[task / num_kv_heads];
        const int64_t kv_head = task % num_kv_heads, rows = c.count * group;
        q_rows.resize(rows * head_size);
        out_rows.resize(rows);
        for (int64_t row = 0; row < rows; ++row) {
          const int64_t token = c.token + row / group, head = kv_head * group + row % group;
          const T* src = q_base + token * q_stride + head * head_size;
          float* dst = q_rows.data() + row * head_size;
#pragma omp simd
          for (int64_t d = 0; d < head_size; ++d) dst[d] = to_float(src[d]) * fscale;
          out_rows[row] = o_base + token * out_stride + head * head_size;
        }
        attend_rows(q_rows.data(), rows, group, c.first_pos,
                    KvTiles<T>{kc, vc, table + c.req * bt_stride, kv_head, num_kv_heads, head_size, block_size}, scores,
                    acc.data(), out_rows.data());
      }
    });
  });
}

}  // namespace raylm
