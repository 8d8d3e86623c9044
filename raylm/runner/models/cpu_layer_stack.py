"""The decoder layers of a CPU step in one kernel call (`csrc/decoder_layers.h`), where every linear of the step
takes a kernel the call can run: the skinny kernel on float weights, or a quantized layer's block kernels (`packed`,
`packed_int8`, `amx`, `packed_bf16`) on its blocks.

The call runs the kernels LlamaDecoderLayer.forward runs, in the same order on the same tensors (float32 or bfloat16,
the model's dtype: the kernels take both), so its output is bit-identical; what it saves is the Python between them
(module calls, views, argument checks: ~100 µs a layer, ~4 ms of a 30-layer decode step of SmolLM2 on a 2-core EPYC).
It is the CPU's counterpart of replaying a CUDA graph, and `enforce_eager` turns it off the same way. Layers it cannot
run as written (Qwen3's q/k norm, MoE, LoRA, a permuted or quantized linear input, tensor parallelism, a KV
connector's per-layer hooks) keep the module-by-module path, and so does a step whose rows some linear's plan gives
to a kernel the call cannot run (oneDNN, sgemm).
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
from raylm.runner.layers.cpu_gemm import GemmPlan
from raylm.runner.layers.linear import LinearBase
from raylm.runner.layers.quantization import kernels as block_kernels
from raylm.runner.layers.rotary_embedding import RotaryEmbedding
from raylm.runner.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from raylm.runner.parallel_state import get_tp_group

logger = logging.getLogger(__name__)

# The kernels the call can run, by their plan names, as decoder_layers.h's LinearKernel numbers them.
STACK_KERNELS = {"skinny": 0, "packed": 1, "packed_int8": 2, "amx": 3, "packed_bf16": 4}


def stack_kernels(linear: LinearBase, dtype: torch.dtype) -> frozenset[str]:
    """The plan kernels the call can run for `linear` on activations of `dtype`: skinny where its panels are in
    that dtype (a quantized layer's copy only without a bias, which its Python path adds after the product), and a
    quantized layer's block kernels where it has them."""
    runnable = set()
    if (linear.skinny_weight is not None and linear.skinny_weight.dtype == dtype
            and (linear.block_matmul is None or linear.bias is None)):
        runnable.add("skinny")
    if linear.block_matmul is not None:
        runnable.add("packed")
    if linear.int8_matmul is not None:
        runnable.add("packed_int8")
    if linear.amx_matmul is not None and dtype == torch.bfloat16:
        runnable.add("amx")
    if linear.bf16_matmul is not None and dtype == torch.bfloat16:
        runnable.add("packed_bf16")
    return frozenset(runnable)


class CpuLayerStack:
    """One pipeline stage's decoder layers, run by `decoder_layers` where `runs` says so."""

    def __init__(self, layers: list[LlamaDecoderLayer]) -> None:
        first = layers[0]
        attention, mlp = first.self_attn, cast(LlamaMLP, first.mlp)  # why_not_stacked checked each layer's type
        dtype = first.input_layernorm.weight.dtype
        self.layers = layers
        self.linears = [linear for layer in layers for linear in linears_of(layer)]
        self.runnable = [stack_kernels(linear, dtype) for linear in self.linears]
        self.step_kernels: list[str] | None = None  # each linear's kernel for the step runs() last accepted
        # A quantized layer's kernel type number (its weight's `quant_format`, set by block_quant.py: ggml's type,
        # or raylm's for F8_E4M3); 0 for a float layer.
        self.qtypes = [0 if linear.block_matmul is None
                       else linear.weight.quant_format.ggml_type  # type: ignore[attr-defined]
                       for linear in self.linears]
        quant_ops = block_kernels.load() if any(linear.block_matmul is not None for linear in self.linears) else None
        self.quant_linear = 0 if quant_ops is None else quant_ops.stack_linear_address()
        self.rotary = attention.rotary_emb
        self.scale, self.eps = attention.attn.scale, first.input_layernorm.variance_epsilon
        hidden_size, intermediate_size = mlp.down_proj.gemm_shape()
        self.dims = [attention.num_heads, attention.num_kv_heads, attention.head_dim, self.rotary.rotary_dim,
                     hidden_size, intermediate_size]

    def kernels_for(self, rows: int) -> list[str] | None:
        """Each linear's planned kernel at this many rows, or None where one is a kernel the call cannot run."""
        chosen: dict[GemmPlan, str] = {}
        kernels = []
        for linear, runnable in zip(self.linears, self.runnable, strict=True):
            plan = linear.gemm_plan
            if plan is None:
                return None
            kernel = chosen.get(plan) or chosen.setdefault(plan, plan.kernel_for(rows))
            if kernel not in runnable:
                return None
            kernels.append(kernel)
        return kernels

    def runs(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> bool:
        """Whether this step can take the stack: a CPU attention step without a KV connector, the kernels on,
        and every linear planned to a kernel the call runs at this many rows."""
        context = current_forward_context()
        if not (context is not None and isinstance(context.attn_metadata, CPUAttentionMetadata)
                and context.kv_connector is None and cpu_kernels.ops_for(hidden_states) is not None
                and positions.dtype == torch.int64 and hidden_states.is_contiguous()):
            return False
        self.step_kernels = self.kernels_for(hidden_states.shape[0])  # what forward runs, chosen once a step
        return self.step_kernels is not None

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        context = current_forward_context()
        assert context is not None and isinstance(context.attn_metadata, CPUAttentionMetadata), "runs() first"
        metadata = context.attn_metadata
        ops = cpu_kernels.load()
        kernels = self.step_kernels
        assert ops is not None and kernels is not None and len(kernels) == len(self.linears), "runs() first"
        weights: list[torch.Tensor | None] = []
        biases: list[torch.Tensor | None] = []
        for index, layer in enumerate(self.layers):
            attention, mlp = layer.self_attn, cast(LlamaMLP, layer.mlp)
            linears = self.linears[4 * index:4 * index + 4]
            qkv, o, gate_up, down = (linear.skinny_weight if kernel == "skinny" else linear.weight
                                     for linear, kernel in zip(linears, kernels[4 * index:4 * index + 4], strict=True))
            weights += (layer.input_layernorm.weight, qkv, o, layer.post_attention_layernorm.weight, gate_up, down)
            biases += (attention.qkv_proj.bias, attention.o_proj.bias, mlp.gate_up_proj.bias, mlp.down_proj.bias)
        kv_caches = [layer.self_attn.attn.kv_cache for layer in self.layers]
        return ops.decoder_layers(hidden_states, residual, positions.contiguous(), weights, biases, kv_caches,
                                  self.rotary.cos_sin_cache, metadata.slot_mapping, metadata.block_table,
                                  metadata.seq_lens, metadata.query_start_loc, metadata.num_actual_tokens, self.scale,
                                  self.eps, self.dims, [STACK_KERNELS[kernel] for kernel in kernels], self.qtypes,
                                  self.quant_linear, block_kernels.MAX_DIRECT_ROWS)


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
        if any(linear.lora is not None for linear in linears_of(layer)):
            return "its linears carry LoRA"
        if not all(stack_kernels(linear, layer.input_layernorm.weight.dtype) for linear in linears_of(layer)):
            return "a linear has no kernel the fused layers can call (skinny panels in the activations' dtype, or " \
                   "block kernels)"
        if any(linear.quant_method.changes_input(linear) for linear in linears_of(layer)):
            return "a quantized linear permutes or quantizes its input (GPTQ act-order, W8A8), which the fused " \
                   "layers do not do"
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
    logger.info("cpu layer stack: steps whose linears all take the skinny or block kernels run the %d decoder layers "
                "in one kernel call (enforce_eager turns this off)", inner.end_layer - inner.start_layer)
