// A Llama decoder-layer stack in one call: the kernels LlamaDecoderLayer.forward runs on a step whose linears all
// take a kernel the stack can call (the skinny kernel, or a quantized layer's block kernels), in the same order on the
// same tensors, so the result is bit-identical; only the Python between them (~100 µs a layer: module calls, views,
// argument checks) is gone. models/cpu_layer_stack.py decides where it applies; this is the CPU's counterpart of
// replaying a captured CUDA graph.
#pragma once

#include "kv_cache_write.h"
#include "layer_ops.h"
#include "paged_attention.h"
#include "skinny_gemm.h"

namespace raylm {

// A layer's tensors, in this order: input_layernorm, qkv_proj, o_proj, post_attention_layernorm, gate_up_proj,
// down_proj (each linear as its kernel reads it: pack_skinny's panels, or the quantized blocks).
constexpr size_t kLayerWeights = 6;
// A layer's linears (qkv_proj, o_proj, gate_up_proj, down_proj): a bias each, optional, and a kernel each.
constexpr size_t kLayerLinears = 4;

// The kernel a linear of the stack runs. The block kernels live in the quantized kernels' library
// (csrc/quant/block_gemm.cpp), built apart; the stack calls them through the address of its `stack_linear`, which
// takes these numbers. cpu_layer_stack.py's STACK_KERNELS names them.
enum LinearKernel : int64_t { kSkinny = 0, kPacked = 1, kPackedInt8 = 2, kAmx = 3, kPackedBf16 = 4 };
using QuantLinear = torch::Tensor (*)(const torch::Tensor& x, const torch::Tensor& w, int64_t kernel, int64_t qtype,
                                      int64_t n, const c10::optional<torch::Tensor>& bias, int64_t max_direct_rows);

// How the stack's linears run: a kernel and a ggml type (the quantized ones) per linear, in layer order.
struct StepLinears {
  std::vector<int64_t> kernels, qtypes;
  QuantLinear quant_linear;  // null where every linear is skinny
  int64_t max_direct_rows;   // the packed kernel's row limit for decoding blocks in registers

  torch::Tensor operator()(size_t index, const torch::Tensor& x, const torch::Tensor& w, int64_t n,
                           const c10::optional<torch::Tensor>& bias) const {
    if (kernels[index] == kSkinny) return skinny_linear(x, w, n, bias);
    TORCH_CHECK(quant_linear != nullptr, "a block kernel was asked for without the quantized kernels' address");
    return quant_linear(x, w, kernels[index], qtypes[index], n, bias, max_direct_rows);
  }
};

struct LayerShape {
  int64_t num_heads, num_kv_heads, head_size, rotary_dim, hidden_size, intermediate_size;
};

// The step's attention inputs, as CPUAttentionMetadata holds them.
struct StepAttention {
  torch::Tensor slot_mapping, block_table, seq_lens, query_start_loc;
  int64_t num_actual_tokens;
  double scale;
};

// CPUAttentionBackend.forward: the new keys and values into the layer's cache, then attention over it.
inline torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& kv_cache, const StepAttention& step, const LayerShape& shape) {
  const int64_t num_tokens = q.size(0), n = step.num_actual_tokens;
  const auto query = q.unflatten(-1, {shape.num_heads, shape.head_size});
  const auto key = k.unflatten(-1, {shape.num_kv_heads, shape.head_size});
  const auto value = v.unflatten(-1, {shape.num_kv_heads, shape.head_size});
  const auto key_cache = kv_cache.select(0, 0), value_cache = kv_cache.select(0, 1);
  write_kv(key.narrow(0, 0, n), value.narrow(0, 0, n), key_cache, value_cache, step.slot_mapping);
  auto out = torch::empty({num_tokens, shape.num_heads, shape.head_size}, q.options());
  if (n < num_tokens) out.narrow(0, n, num_tokens - n).zero_();  // padding rows
  paged_attention(out, query, key_cache, value_cache, step.block_table, step.seq_lens, step.query_start_loc,
                  step.scale);
  return out.view({num_tokens, shape.num_heads * shape.head_size});
}

// (hidden_states, residual) after the layers, as LlamaModel.forward threads them; `residual` is None before the
// first layer of the model.
inline std::tuple<torch::Tensor, torch::Tensor> decoder_layers(
    torch::Tensor hidden, c10::optional<torch::Tensor> residual_in, torch::Tensor positions,
    const std::vector<torch::Tensor>& weights, const std::vector<c10::optional<torch::Tensor>>& biases,
    const std::vector<torch::Tensor>& kv_caches, torch::Tensor cos_sin_cache, torch::Tensor slot_mapping,
    torch::Tensor block_table, torch::Tensor seq_lens, torch::Tensor query_start_loc, int64_t num_actual_tokens,
    double scale, double eps, std::vector<int64_t> dims, std::vector<int64_t> linear_kernels,
    std::vector<int64_t> linear_qtypes, int64_t quant_linear, int64_t max_direct_rows) {
  TORCH_CHECK(dims.size() == 6, "dims: num_heads, num_kv_heads, head_size, rotary_dim, hidden, intermediate");
  const LayerShape shape{dims[0], dims[1], dims[2], dims[3], dims[4], dims[5]};
  const size_t num_layers = kv_caches.size();
  TORCH_CHECK(weights.size() == num_layers * kLayerWeights && biases.size() == num_layers * kLayerLinears &&
                  linear_kernels.size() == num_layers * kLayerLinears &&
                  linear_qtypes.size() == num_layers * kLayerLinears,
              "weights, biases, linear_kernels and linear_qtypes must hold every layer's, in order");
  const StepLinears linear{std::move(linear_kernels), std::move(linear_qtypes),
                           reinterpret_cast<QuantLinear>(quant_linear), max_direct_rows};
  const StepAttention step{slot_mapping, block_table, seq_lens, query_start_loc, num_actual_tokens, scale};
  const int64_t q_size = shape.num_heads * shape.head_size, kv_size = shape.num_kv_heads * shape.head_size;
  torch::Tensor residual = residual_in.value_or(torch::Tensor());
  for (size_t layer = 0; layer < num_layers; ++layer) {
    const torch::Tensor* w = &weights[layer * kLayerWeights];
    const size_t l = layer * kLayerLinears;  // the layer's first linear
    const c10::optional<torch::Tensor>* b = &biases[l];
    if (!residual.defined()) {
      residual = hidden;
      hidden = rms_norm(hidden, w[0], eps);
    } else {
      fused_add_rms_norm(hidden, residual, w[0], eps);
    }
    const auto qkv = linear(l, hidden, w[1], q_size + 2 * kv_size, b[0]);
    const auto q = qkv.narrow(1, 0, q_size), k = qkv.narrow(1, q_size, kv_size);
    rotary_embedding(positions, q, k, cos_sin_cache, shape.head_size, shape.rotary_dim);
    const auto attn = attend(q, k, qkv.narrow(1, q_size + kv_size, kv_size), kv_caches[layer], step, shape);
    hidden = linear(l + 1, attn, w[2], shape.hidden_size, b[1]);
    fused_add_rms_norm(hidden, residual, w[3], eps);
    const auto gate_up = linear(l + 2, hidden, w[4], 2 * shape.intermediate_size, b[2]);
    hidden = linear(l + 3, silu_and_mul(gate_up), w[5], shape.hidden_size, b[3]);
  }
  return {hidden, residual};
}

}  // namespace raylm
