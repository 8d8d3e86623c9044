// Paged causal GQA attention over the KV cache that kv_cache_write.h fills: float32 or bfloat16 queries, cache and
// output, float32 scores, softmax and sums (a bfloat16 key or value row widens to float32 as it is loaded). A layer may
// have a sliding window (a query sees its last `sliding_window` positions, itself included; tiles before every row's
// window are never read), a logit soft-cap (scores become cap * tanh(scores / cap) before the softmax) and attention
// sinks (GPT-OSS: a learned logit per query head that joins each softmax's denominator, weighting no value).
#pragma once

#include "attention_tiles.h"

namespace raylm {

// tanh lane-wise: an odd polynomial near zero, where 1 - exp(-2|x|) would cancel, (1 - t) / (1 + t) with
// t = exp(-2|x|) elsewhere (~1e-7 relative).
inline lanes_t vtanh(lanes_t x) {
  const lanes_t ax = x < 0.0f ? -x : x, x2 = x * x;
  const lanes_t small = x * (1.0f + x2 * (-1.0f / 3 + x2 * (2.0f / 15 + x2 * (-17.0f / 315))));
  const lanes_t t = vexp(-2.0f * ax), large = (1.0f - t) / (1.0f + t);
  return ax < 0.0625f ? small : (x < 0.0f ? -large : large);
}

// scores[first:n) = exp(scores - their max) in place, zero before `first` and from n up to `stride` (a multiple of
// kTile); returns their sum. With a soft-cap the scores are capped first. A finite `sink` joins the max and the sum
// (exp(sink - max)), so the row's weights sum to less than one; -INFINITY adds nothing.
inline float softmax_row(float* scores, int64_t first, int64_t n, int64_t stride, float soft_cap, float sink) {
  const int64_t last = (n - 1) / kTile * kTile;  // the vector holding the row's last key
  const int64_t first_vector = first / kTile * kTile;
  auto visible = [&](int64_t i) {  // lanes of the vector at i that hold keys in [first, n)
    const int_lanes_t index = lane_index() + static_cast<int32_t>(i);
    return index >= static_cast<int32_t>(first) && index < static_cast<int32_t>(n);
  };
  if (soft_cap > 0.0f)
    for (int64_t i = first_vector; i <= last; i += kTile)
      store_lanes(scores + i, soft_cap * vtanh(load_lanes(scores + i) * (1.0f / soft_cap)));
  lanes_t max = broadcast(-INFINITY);
  for (int64_t i = first_vector; i <= last; i += kTile) {
    const lanes_t s = load_lanes(scores + i);
    max = vmax(max, i == first_vector || i == last ? (visible(i) ? s : broadcast(-INFINITY)) : s);
  }
  const float row_max = std::max(hmax(max), sink);
  lanes_t sum = {};
  for (int64_t i = first_vector; i <= last; i += kTile) {
    lanes_t e = vexp(load_lanes(scores + i) - row_max);
    if (i == first_vector || i == last) e = visible(i) ? e : lanes_t{};
    store_lanes(scores + i, e);
    sum += e;
  }
  std::fill(scores, scores + first_vector, 0.0f);
  std::fill(scores + last + kTile, scores + stride, 0.0f);
  return hsum(sum) + std::exp(sink - row_max);
}

// One task's rows over their causal keys: row r (query token r / group of the task, one of its KV head's group
// query heads) sees keys [0, first_pos + r / group + 1), or its last `window` of them. Two passes: every row's
// scores first (a row block shares each key tile), then one softmax per row over whole vectors, then the values,
// weighted, from the same tiles. Unlike an online softmax, no running max, sum and rescale per tile, which cost more
// than the dot products when a task has a handful of rows (a decode's G heads). Writes each row's normalized output
// to out_rows[r]. `sinks` (null: none) holds the sink logit of each of the task's G query heads.
template <typename T>
void attend_rows(const float* q_rows, int64_t rows, int64_t group, int64_t first_pos, int64_t window,
                 float soft_cap, const float* sinks, const KvTiles<T>& tiles, std::vector<float>& scores, float* acc,
                 T* const* out_rows) {
  const int64_t head_size = tiles.head_size, block_size = tiles.block_size;
  const int64_t num_keys = first_pos + (rows - 1) / group + 1;  // keys the last row sees
  auto first_key = [&](int64_t row) {  // the first key row `row` sees
    return window > 0 ? std::max<int64_t>(0, first_pos + row / group + 1 - window) : 0;
  };
  // Scores are kept from key0, the tile of the first row's first key: no row sees a key before it.
  const int64_t key0 = first_key(0) / kTile * kTile;
  const int64_t stride = (num_keys - key0 + kTile - 1) / kTile * kTile;
  auto block_keys = [&](int64_t row0) {  // keys the last row of the block at row0 sees
    return first_pos + (std::min(row0 + kRowBlock, rows) - 1) / group + 1;
  };
  scores.resize(rows * stride);
  // Blocks lie anywhere in the pool, beyond the hardware prefetcher's reach: the kernel asks for each tile ahead.
  tiles.prefetch_first_keys(key0, num_keys);
  for (int64_t start = key0; start < num_keys; start += kTile) {
    const T* ahead_tile = tiles.key_ahead(start, num_keys);
    const T* k_tile = tiles.key(start);
    for (int64_t row0 = 0; row0 < rows; row0 += kRowBlock) {
      if (start >= block_keys(row0)) continue;  // beyond every causal limit of this block (later blocks see more)
      const float* q = q_rows + row0 * head_size;
      float* s = scores.data() + row0 * stride + start - key0;
      const T* ask = row0 == 0 ? ahead_tile : nullptr;  // the first row block asks for the tile ahead
      with_rows<kRowBlock>(std::min(kRowBlock, rows - row0), [&](auto r) {
        store_scores<decltype(r)::value, T>(q, k_tile, head_size, block_size, s, stride, ask);
      });
    }
  }
  tiles.prefetch_first_values(key0, num_keys);
  for (int64_t row0 = 0; row0 < rows; row0 += kRowBlock) {
    const int64_t block_rows = std::min(kRowBlock, rows - row0), keys = block_keys(row0);
    const int64_t block_stride = (keys - key0 + kTile - 1) / kTile * kTile;
    float sums[kRowBlock];
    for (int64_t r = 0; r < block_rows; ++r) {
      const int64_t row = row0 + r;
      sums[r] = softmax_row(scores.data() + row * stride, first_key(row) - key0, first_pos + row / group + 1 - key0,
                            block_stride, soft_cap, sinks != nullptr ? sinks[row % group] : -INFINITY);
    }
    const float* p = scores.data() + row0 * stride;
    with_rows<kRowBlock>(block_rows, [&](auto r) {
      accumulate_values<decltype(r)::value, T>(acc, p, stride, tiles, key0, keys, row0 == 0);
    });
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
                            torch::Tensor query_start_loc, double scale, int64_t sliding_window = 0,
                            double soft_cap = 0.0, const c10::optional<torch::Tensor>& sinks = c10::nullopt) {
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
  TORCH_CHECK(sliding_window >= 0 && soft_cap >= 0.0, "sliding_window and soft_cap must be >= 0 (0: none)");
  TORCH_CHECK(!sinks || (sinks->scalar_type() == torch::kFloat32 && sinks->is_contiguous() &&
                         sinks->numel() == num_heads),
              "sinks must be a contiguous float32 tensor of one logit per query head");
  const float* sink_base = sinks ? sinks->data_ptr<float>() : nullptr;
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
    const int64_t span = sliding_window > 0 ? std::min<int64_t>(lens[r], sliding_window + kChunk) : lens[r];
    const auto chunk = static_cast<int32_t>(
        std::clamp<int64_t>(kScoresBytes / (group * std::max<int64_t>(span, 1) * sizeof(float)), 1, kChunk));
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
    const int64_t keys = c.first_pos + c.count;  // the last query's keys, or its window's
    const int64_t seen = sliding_window > 0 ? std::min<int64_t>(keys, sliding_window + c.count) : keys;
    work_before[task + 1] = work_before[task] + int64_t{c.count} * seen;
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
        const float* task_sinks = sink_base != nullptr ? sink_base + kv_head * group : nullptr;
        attend_rows(q_rows.data(), rows, group, c.first_pos, sliding_window, static_cast<float>(soft_cap),
                    task_sinks, KvTiles<T>{kc, vc, table + c.req * bt_stride, kv_head, num_kv_heads, head_size,
                                           block_size},
                    scores, acc.data(), out_rows.data());
      }
    });
  });
}

}  // namespace raylm
