"""The decoder layers of a CPU step in one kernel call (`csrc/decoder_layers.h`), where every linear of the step
takes the skinny kernel (decode steps and short chunks).

The call runs the kernels LlamaDecoderLayer.forward runs, in the same order on the same tensors (float32 or bfloat16,
the model's dtype: the kernels take both), so its output is bit-identical; what it saves is the Python between them
(module calls, views, argument checks: ~100 µs a layer, ~4 ms of a 30-layer decode step of SmolLM2 on a 2-core EPYC).
It is the CPU's counterpart of replaying a CUDA graph, and `enforce_eager` turns it off the same way. Layers it cannot
run as written (Qwen3's q/k norm, MoE, LoRA, a permuted or quantized linear input, tensor parallelism, a KV
connector's per-layer hooks) keep the module-by-module path.
"""
from __future__ import annotations

import logging
from itertools import islice
from typing import cast

import torch
from torch import nn

from raylm.common.logger import show_info
from raylm.runner import cpu_kernels
from raylm.runner.attention.cpu_backend import CPUAttentionMetadata
from raylm.runner.forward_context import current_forward_context
from raylm.runner.layers.linear import LinearBase
from raylm.runner.layers.rotary_embedding import RotaryEmbedding
from raylm.runner.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from raylm.runner.parallel_state import get_tp_group

logger = logging.getLogger(__name__)


class CpuLayerStack:
    """One pipeline stage's decoder layers, run by `decoder_layers` where `runs` says so."""

    def __init__(self, layers: list[LlamaDecoderLayer]) -> None:
        first = layers[0]
        attention, mlp = first.self_attn, cast(LlamaMLP, first.mlp)  # why_not_stacked checked each layer's type
        self.layers = layers
        self.plans = [linear.gemm_plan for linear in linears_of(first)]  # one per shape, shared by every layer
        self.rotary = attention.rotary_emb
        self.scale, self.eps = attention.attn.scale, first.input_layernorm.variance_epsilon
        hidden_size, intermediate_size = mlp.down_proj.gemm_weight().shape  # a quantized layer's float copy
        self.dims = [attention.num_heads, attention.num_kv_heads, attention.head_dim, self.rotary.rotary_dim,
                     hidden_size, intermediate_size]

    def runs(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> bool:
        """Whether this step can take the stack: a CPU attention step without a KV connector, the kernels on,
        and every linear planned to the skinny kernel at this many rows."""
        context = current_forward_context()
        rows = hidden_states.shape[0]
        return (context is not None and isinstance(context.attn_metadata, CPUAttentionMetadata)
                and context.kv_connector is None and cpu_kernels.ops_for(hidden_states) is not None
                and positions.dtype == torch.int64 and hidden_states.is_contiguous()
                and all(plan is not None and plan.kernel_for(rows) == "skinny" for plan in self.plans))

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        context = current_forward_context()
        assert context is not None and isinstance(context.attn_metadata, CPUAttentionMetadata), "runs() first"
        metadata = context.attn_metadata
        ops = cpu_kernels.load()
        assert ops is not None
        weights: list[torch.Tensor | None] = []  # each planned to the skinny kernel: none is None (why_not_stacked)
        biases: list[torch.Tensor | None] = []
        for layer in self.layers:
            attention, mlp = layer.self_attn, cast(LlamaMLP, layer.mlp)
            weights += (layer.input_layernorm.weight, attention.qkv_proj.skinny_weight, attention.o_proj.skinny_weight,
                        layer.post_attention_layernorm.weight, mlp.gate_up_proj.skinny_weight,
                        mlp.down_proj.skinny_weight)
            biases += (attention.qkv_proj.bias, attention.o_proj.bias, mlp.gate_up_proj.bias, mlp.down_proj.bias)
        kv_caches = [layer.self_attn.attn.kv_cache for layer in self.layers]
        return ops.decoder_layers(hidden_states, residual, positions.contiguous(), weights, biases, kv_caches,
                                  self.rotary.cos_sin_cache, metadata.slot_mapping, metadata.block_table,
                                  metadata.seq_lens, metadata.query_start_loc, metadata.num_actual_tokens, self.scale,
                                  self.eps, self.dims)


def linears_of(layer: LlamaDecoderLayer) -> tuple[LinearBase, ...]:
    """The layer's four linears; its MLP is Llama's (why_not_stacked checks that before it asks)."""
    attention, mlp = layer.self_attn, cast(LlamaMLP, layer.mlp)
    return attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj


def why_not_stacked(model: nn.Module) -> str | None:
    """Why `model`'s layers cannot run as one call (None: they can)."""
    if not isinstance(model, LlamaForCausalLM):
        return f"{type(model).__name__} is not a Llama-shaped model"
    if get_tp_group().world_size > 1:
        return "tensor parallelism all-reduces inside each layer"
    inner = model.model
    layers = cast(list[LlamaDecoderLayer], list(islice(inner.layers, inner.start_layer, inner.end_layer)))
    for layer in layers:
        if type(layer).forward is not LlamaDecoderLayer.forward or type(layer.self_attn) is not LlamaAttention:
            return f"{type(layer).__name__} changes the Llama layer (e.g. a q/k norm)"
        if layer.self_attn.attn.features:
            return "its attention has a sliding window or a logit soft-cap, which the fused layers do not apply"
        if type(layer.mlp) is not LlamaMLP:
            return f"{type(layer.mlp).__name__} is not Llama's MLP"
        if type(layer.self_attn.rotary_emb) is not RotaryEmbedding:
            return "its rotary embedding is not the neox kind"
        if any(linear.skinny_weight is None or linear.lora is not None for linear in linears_of(layer)):
            return "its linears are not planned to the skinny kernel, or carry LoRA"
        if any(linear.quant_method.changes_input(linear) for linear in linears_of(layer)):
            return "a quantized linear permutes or quantizes its input (GPTQ act-order, W8A8), which the fused " \
                   "layers do not do"
        if any(linear.gemm_weight().dtype != layer.input_layernorm.weight.dtype for linear in linears_of(layer)):
            return "its linears' weights (a quantized layer's float copy) are not in the activations' dtype"
        if {layer.input_layernorm.variance_epsilon, layer.post_attention_layernorm.variance_epsilon} != {
                layers[0].input_layernorm.variance_epsilon}:
            return "its norms differ in eps"
    return None if layers else "this stage has no layers"


def stack_layers(model: nn.Module) -> None:
    """Give `model` (loaded, its linears planned, LoRA attached if enabled) a CpuLayerStack where its layers allow
    one, and say so."""
    why_not = why_not_stacked(model)
    if why_not is not None:
        logger.debug("decoder layers run module by module: %s", why_not)
        return
    assert isinstance(model, LlamaForCausalLM)
    inner = model.model
    inner.layer_stack = CpuLayerStack(cast(list[LlamaDecoderLayer],
                                           list(islice(inner.layers, inner.start_layer, inner.end_layer))))
    show_info(logger)
    logger.info("cpu layer stack: steps whose linears all take the skinny kernel run the %d decoder layers in one "
                "kernel call (enforce_eager turns this off)", inner.end_layer - inner.start_layer)
