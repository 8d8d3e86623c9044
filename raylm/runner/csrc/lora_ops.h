// The LoRA product of a batch in one call per linear (punica's shrink and expand fused): each token against its own
// adapter slot's rows, straight from x's rows into y's. At decode sizes torch's route (a gather, a batched shrink, an
// expand per output slice, a scatter-add) is ~8 ops of a few µs each per linear, more than the FLOPs they carry.
#pragma once

#include "vec_math.h"

namespace raylm {

constexpr int64_t kLoraBlock = 4;  // tokens of one slot sharing each read of the slot's weight rows

// shrunk[t][c] = sum_k x_rows[t][k] * a[k][c] for the block's N tokens over one register of columns from c: one
// accumulator per token kept in a register over all of k (N is a template argument so that they stay there), so that
// each load of a's row feeds N multiply-adds.
template <int64_t N>
void shrink_columns(const float* const* x_rows, const float* a, int64_t in, int64_t cols, int64_t c, float* shrunk) {
  lanes_t acc[N] = {};
  for (int64_t k = 0; k < in; ++k) {
    const lanes_t a_k = load_lanes(a + k * cols + c);
    for (int64_t t = 0; t < N; ++t) acc[t] += x_rows[t][k] * a_k;
  }
  for (int64_t t = 0; t < N; ++t) store_lanes(shrunk + t * cols + c, acc[t]);
}

template <int64_t N>
void shrink_block(const float* const* x_rows, const float* a, int64_t in, int64_t cols, float* shrunk) {
  int64_t c = 0;
  for (; c + kLanes <= cols; c += kLanes) shrink_columns<N>(x_rows, a, in, cols, c, shrunk);
  if (c == cols) return;
  if (cols >= kLanes) {  // the last register's columns again, overlapping: stored, not added, so that is harmless
    shrink_columns<N>(x_rows, a, in, cols, cols - kLanes, shrunk);
    return;
  }
  float acc[N][kLanes] = {};  // fewer columns than a register (small ranks of one slice)
  for (int64_t k = 0; k < in; ++k) {
    for (int64_t t = 0; t < N; ++t) {
      const float xv = x_rows[t][k];
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) acc[t][j] += xv * a[k * cols + j];
    }
  }
  for (int64_t t = 0; t < N; ++t) std::memcpy(shrunk + t * cols, acc[t], cols * sizeof(float));
}

// y_rows[t][c] += sum_r shrunk[t][r] * b[r][c] for c in [col_begin, col_end): a register of columns at a time,
// accumulated in registers over the rank.
template <int64_t N>
void expand_block(const float* shrunk, int64_t shrunk_stride, const float* b, int64_t rank, int64_t out,
                  int64_t col_begin, int64_t col_end, float* const* y_rows) {
  int64_t c = col_begin;
  for (; c + kLanes <= col_end; c += kLanes) {
    lanes_t acc[N];
    for (int64_t t = 0; t < N; ++t) acc[t] = load_lanes(y_rows[t] + c);
    for (int64_t r = 0; r < rank; ++r) {
      const lanes_t b_r = load_lanes(b + r * out + c);
      for (int64_t t = 0; t < N; ++t) acc[t] += shrunk[t * shrunk_stride + r] * b_r;
    }
    for (int64_t t = 0; t < N; ++t) store_lanes(y_rows[t] + c, acc[t]);
  }
  const int64_t tail = col_end - c;
  if (tail == 0) return;
  float acc[N][kLanes];
  for (int64_t t = 0; t < N; ++t) std::memcpy(acc[t], y_rows[t] + c, tail * sizeof(float));
  for (int64_t r = 0; r < rank; ++r) {
    const float* b_r = b + r * out + c;
    for (int64_t t = 0; t < N; ++t) {
      const float sv = shrunk[t * shrunk_stride + r];
#pragma omp simd
      for (int64_t j = 0; j < tail; ++j) acc[t][j] += sv * b_r[j];
    }
  }
  for (int64_t t = 0; t < N; ++t) std::memcpy(y_rows[t] + c, acc[t], tail * sizeof(float));
}

// One block: N tokens of one slot, against that slot's lora_a_t (a) and lora_b (b).
template <int64_t N>
void lora_block(const float* const* x_rows, float* const* y_rows, const float* a, const float* b, int64_t in,
                int64_t shrunk_cols, int64_t rank, int64_t out, const std::vector<int64_t>& bounds, float* shrunk) {
  shrink_block<N>(x_rows, a, in, shrunk_cols, shrunk);
  for (size_t i = 0; i + 1 < bounds.size(); ++i) {
    expand_block<N>(shrunk + i * rank, shrunk_cols, b, rank, out, bounds[i], bounds[i + 1], y_rows);
  }
}

// y[t] += sum_i (x[t] @ lora_a_t[s][:, i*R:(i+1)*R]) @ lora_b[s][:, bounds[i]:bounds[i+1]] for each token t =
// tokens[j] with slot s = slots[j]. lora_a_t [S, in, n*R] (the slices' lora_a transposed, side by side), lora_b
// [S, R, out] (slice i's lora_b transposed in its output columns), bounds: the n + 1 slice edges in y's columns.
// tokens are sorted by slot, so a slot's tokens come as blocks that read its weights once.
inline void add_lora(torch::Tensor y, torch::Tensor x, torch::Tensor tokens, torch::Tensor slots,
                     torch::Tensor lora_a_t, torch::Tensor lora_b, std::vector<int64_t> bounds) {
  check_rows(x, "x");
  check_rows(y, "y");
  TORCH_CHECK(lora_a_t.is_contiguous() && lora_b.is_contiguous() && lora_a_t.scalar_type() == torch::kFloat32 &&
                  lora_b.scalar_type() == torch::kFloat32,
              "lora_a_t and lora_b must be contiguous float32");
  TORCH_CHECK(tokens.scalar_type() == torch::kInt64 && slots.scalar_type() == torch::kInt64 &&
                  tokens.is_contiguous() && slots.is_contiguous() && tokens.numel() == slots.numel(),
              "tokens and slots must be contiguous int64 of one length");
  const int64_t in = x.size(1), num_slices = static_cast<int64_t>(bounds.size()) - 1;
  const int64_t shrunk_cols = lora_a_t.size(2), rank = lora_b.size(1), out = lora_b.size(2);
  TORCH_CHECK(lora_a_t.size(1) == in && shrunk_cols == num_slices * rank && bounds.front() == 0 &&
                  bounds.back() == out && y.size(1) == out,
              "lora_a_t [S, in, n*R], lora_b [S, R, out] and the slice bounds must match x and y");
  const int64_t* token = tokens.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t num = tokens.numel();
  std::vector<int64_t> block_starts;  // blocks of at most kLoraBlock tokens of one slot
  for (int64_t j = 0; j < num; ++j) {
    if (j == 0 || slot[j] != slot[j - 1] || j - block_starts.back() == kLoraBlock) block_starts.push_back(j);
  }
  block_starts.push_back(num);
  const int64_t num_blocks = static_cast<int64_t>(block_starts.size()) - 1;
  const float* xs = x.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  const float* a_all = lora_a_t.data_ptr<float>();
  const float* b_all = lora_b.data_ptr<float>();
  const int64_t x_stride = x.stride(0), y_stride = y.stride(0);
  // ~64K multiply-adds a chunk: a decode step's few blocks split over the threads, a lone token stays on the caller.
  const int64_t block_macs = kLoraBlock * (in * shrunk_cols + rank * out);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, block_macs));
  at::parallel_for(0, num_blocks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> shrunk(kLoraBlock * shrunk_cols);
    const float* x_rows[kLoraBlock];
    float* y_rows[kLoraBlock];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t first = block_starts[blk], count = block_starts[blk + 1] - first;
      for (int64_t t = 0; t < count; ++t) {
        x_rows[t] = xs + token[first + t] * x_stride;
        y_rows[t] = ys + token[first + t] * y_stride;
      }
      const float* a = a_all + slot[first] * in * shrunk_cols;
      const float* b = b_all + slot[first] * rank * out;
      switch (count) {  // kLoraBlock cases
        case 1: lora_block<1>(x_rows, y_rows, a, b, in, shrunk_cols, rank, out, bounds, shrunk.data()); break;
        case 2: lora_block<2>(x_rows, y_rows, a, b, in, shrunk_cols, rank, out, bounds, shrunk.data()); break;
        case 3: lora_block<3>(x_rows, y_rows, a, b, in, shrunk_cols, rank, out, bounds, shrunk.data()); break;
        default: lora_block<4>(x_rows, y_rows, a, b, in, shrunk_cols, rank, out, bounds, shrunk.data()); break;
      }
    }
  });
}

}  // namespace raylm
