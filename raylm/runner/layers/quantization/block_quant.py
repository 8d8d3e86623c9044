"""`quantization: int8 | int4 | gguf`: linear layers (the LM head, a tied embedding) whose weights stay in ggml's
block formats, sharded for TP as packed bytes and run by the block kernels (as are the checkpoint formats'
blocks, FP8's F8_E4M3 among them: checkpoint_formats.py).

- `int8`: every linear weight quantized at load to Q8_0 (symmetric int8, one scale per 32 weights).
- `int4`: linear weights to Q4_1 (4-bit, a scale and an offset per 32 weights: the groupwise scale + zero of AWQ and
  GPTQ); the LM head to Q8_0, as llama.cpp keeps the output layer at higher precision.
- `gguf`: each weight as the GGUF file stores it (Q4_0, Q4_1, Q8_0 run packed; float tensors stay float). A type
  with no kernel here (K-quants, IQ*, ...) is refused by name.

A weight is one uint8 parameter [rows, in_features / 32 * type_bytes] whose rows are output features and whose bytes
run along the input, so the layers' own loaders shard it: rows for column parallel (q/k/v and gate/up offsets
included), whole blocks of each row for row parallel (the input per rank must hold whole blocks). A float weight
reaching a quantized layer is quantized whole before sharding, so TP ranks hold exactly the blocks one device holds.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from raylm.configs import model_info
from raylm.runner.layers.cpu_gemm import BLOCK_KERNELS, CpuGemmMixin, onednn_packs
from raylm.runner.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from raylm.runner.layers.linear import LinearBase, UnquantizedLinearMethod, WeightLoader, set_weight_loader
from raylm.runner.layers.quantization import kernels
from raylm.runner.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from raylm.runner.layers.quantization.ggml_blocks import (
    BLOCK_SIZE,
    Q4_1,
    Q8_0,
    BlockFormat,
    QuantizedTensor,
    dequantize,
    quantize,
)

_FLOAT = UnquantizedLinearMethod()


class BlockQuantMethod(QuantizeMethodBase):
    """One layer's weight in a block format: `fmt`, or with fmt None each checkpoint tensor's own (GGUF). The
    parameter's `quant_format` says which it holds (None: a float weight, as a GGUF F16/F32 tensor loads). `layer`
    is Any to mypy: a linear or embedding layer that this method gives attributes of its own (params_dtype,
    block_kernels, ...) besides CpuGemmMixin's."""

    # Whether the layer may keep a dequantized copy of its weight for the float kernels (where its plan picks them
    # and AMX does not run): not a checkpoint format's (checkpoint_formats.py).
    keeps_float_copy = True

    def __init__(self, fmt: BlockFormat | None) -> None:
        self.fmt = fmt

    def create_weights(self, layer: Any, input_size_per_partition: int, output_size_per_partition: int,
                       weight_loader: WeightLoader) -> None:
        if input_size_per_partition % BLOCK_SIZE:
            raise ValueError(
                f"quantization: {type(layer).__name__} has {input_size_per_partition} input features per TP rank, "
                f"not a multiple of the {BLOCK_SIZE}-weight block (lower tensor_parallel_size, or quantization: none)")
        row_bytes = self.fmt.row_bytes(input_size_per_partition) if self.fmt is not None else 0
        weight = nn.Parameter(torch.empty(output_size_per_partition, row_bytes, dtype=torch.uint8), requires_grad=False)
        weight.quant_format = self.fmt  # type: ignore[attr-defined]
        layer.params_dtype = torch.get_default_dtype()
        layer.in_features_per_partition = input_size_per_partition
        layer.block_kernels = kernels.kernels_for(weight.device, layer.params_dtype)

        def load(param: nn.Parameter, loaded: torch.Tensor | QuantizedTensor, shard_id: object = None) -> None:
            self.load_weight(layer, param, loaded, shard_id, weight_loader)

        layer.weight = set_weight_loader(weight, load)

    def load_weight(self, layer: Any, param: nn.Parameter, loaded: torch.Tensor | QuantizedTensor,
                    shard_id: object, weight_loader: WeightLoader) -> None:
        """Bring `loaded` (a full checkpoint tensor) to the parameter's format, then let the layer shard it. The
        parameter takes its format from the first tensor under `gguf`; a fused weight's shards must agree."""
        fmt, data = self._convert(loaded)
        in_features = layer.in_features_per_partition
        if param.numel() == 0:  # gguf: the first shard decides the layer's format
            shape = (param.shape[0], fmt.row_bytes(in_features) if fmt is not None else in_features)
            param.data = torch.empty(shape, dtype=torch.uint8 if fmt is not None else layer.params_dtype,
                                     device=param.device)
            param.quant_format = fmt  # type: ignore[attr-defined]
        elif param.quant_format is not fmt:  # type: ignore[attr-defined]
            raise ValueError(f"quantization: {_describe(loaded)} is {_name(fmt)} but the other parts of its fused "
                             f"weight are {_name(param.quant_format)}; raylm keeps one format per layer: use "  # type: ignore[attr-defined]
                             "quantization 'int8' or 'int4' to requantize, or 'none'")
        weight_loader(param, data if fmt is not None else data.to(param.dtype), shard_id)

    def _convert(self, loaded: torch.Tensor | QuantizedTensor) -> tuple[BlockFormat | None, torch.Tensor]:
        if isinstance(loaded, QuantizedTensor):
            if loaded.format is None or loaded.blocks is None:
                raise ValueError(f"quantization 'gguf': {_describe(loaded)} has no raylm kernel (raylm runs Q4_0, "
                                 "Q4_1 and Q8_0 packed); use quantization 'int8' or 'int4' to requantize it, or "
                                 "'none' to dequantize to float")
            if self.fmt is None or loaded.format is self.fmt:
                return loaded.format, loaded.blocks
            return self.fmt, quantize(dequantize(loaded.blocks, loaded.format), self.fmt)
        if self.fmt is None:
            return None, loaded
        return self.fmt, quantize(loaded, self.fmt)

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        fmt = layer.weight.quant_format
        if fmt is None:
            return _FLOAT.apply(layer, x, bias)
        if layer.block_matmul is not None:  # the GEMM plan picks the block kernel or a float one on the copy
            return layer.matmul(x, bias)
        return kernels.block_linear(x, layer.weight, fmt, bias, layer.block_kernels)

    def embedding(self, layer: Any, ids: torch.Tensor) -> torch.Tensor:
        fmt = layer.weight.quant_format
        if fmt is None:
            return _FLOAT.embedding(layer, ids)
        return kernels.block_rows(layer.weight, ids, fmt, layer.params_dtype)

    def process_weights_after_loading(self, layer: Any) -> None:
        fmt = layer.weight.quant_format
        # Decided once per layer (device, dtype, custom_ops are fixed by now) rather than on every call.
        layer.block_kernels = kernels.kernels_for(layer.weight.device, layer.params_dtype)
        layer.block_matmul, layer.amx_matmul, layer.int8_matmul, layer.bf16_matmul = None, None, None, None
        layer.dequantized = None
        ops = kernels.kernels_for(layer.weight.device, torch.float32)
        if fmt is not None and ops is not None and isinstance(layer, CpuGemmMixin):
            # The block kernels (float32 in registers; for bfloat16 activations int8 dot products, AMX tiles or
            # AVX512-BF16 dot products where the CPU has them) are candidates of the layer's GEMM plan. Where AMX
            # runs they are the only ones: AMX came within ~10% of oneDNN's bfloat16 matmul on a copy or beat it on
            # decoder shapes (docs/cpu-performance.md), so the weight stays in its blocks, as a checkpoint format's
            # always does (keeps_float_copy). Elsewhere the float kernels, faster at some rows, run on a dequantized
            # copy, made only while the plan is unknown (to time it) or picks them for some rows.
            layer.block_matmul = lambda x, bias: kernels.block_linear(
                x.float(), layer.weight, fmt, None if bias is None else bias.float(), ops).to(x.dtype)
            amx = kernels.amx_kernels_for(layer.weight.device, layer.params_dtype)
            if amx is not None:
                layer.amx_matmul = lambda x, bias: kernels.amx_linear(x, layer.weight, fmt, bias, amx)
            bf16 = kernels.bf16_dot_kernels_for(layer.weight.device, layer.params_dtype)
            if bf16 is not None:
                layer.bf16_matmul = lambda x, bias: kernels.bf16_linear(x, layer.weight, fmt, bias, bf16)
            int8 = kernels.int8_kernels_for(layer.weight.device, layer.params_dtype)
            if int8 is not None and fmt.integer:  # integer dot products: not F8_E4M3's E4M3 values
                layer.int8_matmul = lambda x, bias: kernels.int8_linear(x, layer.weight, fmt, bias, int8)
            copy_dtype = dequantized_dtype(layer.params_dtype)
            plan = layer.gemm_plan
            planned_floats = plan is None or not set(plan.kernels) <= BLOCK_KERNELS
            if self.keeps_float_copy and amx is None and planned_floats and onednn_packs(copy_dtype):
                layer.dequantized = dequantize(layer.weight.detach(), fmt).to(copy_dtype)
        if fmt is None or layer.block_matmul is not None:
            _FLOAT.process_weights_after_loading(layer)

    def kernel_name(self, layer: Any) -> str:
        fmt = layer.weight.quant_format
        if fmt is None or layer.packed_weight is not None:
            return _FLOAT.kernel_name(layer)
        if layer.block_matmul is not None:  # its block kernels, without a float copy: plan_linears times them
            return "planned"
        if layer.block_kernels is not None:
            return f"{fmt.name} blocks"
        triton = kernels.triton_gemm_for(layer.weight.device, layer.params_dtype) is not None
        return f"{fmt.name} blocks ({'Triton' if triton else 'dequantized per call'})"


class BlockQuantConfig(QuantizationConfig):
    def __init__(self, name: str, tie_word_embeddings: bool) -> None:
        self.name = name
        self.linear_format: BlockFormat | None = {"int8": Q8_0, "int4": Q4_1, "gguf": None}[name]
        self.head_format: BlockFormat | None = None if name == "gguf" else Q8_0
        self.tie_word_embeddings = tie_word_embeddings

    def get_quant_method(self, layer: nn.Module) -> QuantizeMethodBase | None:
        if isinstance(layer, ParallelLMHead):
            return BlockQuantMethod(self.head_format)
        if isinstance(layer, VocabParallelEmbedding):
            # A lookup needs no kernel: a float checkpoint's embedding stays float, unless the LM head shares it.
            quantized = self.name == "gguf" or self.tie_word_embeddings
            return BlockQuantMethod(self.head_format) if quantized else None
        if isinstance(layer, LinearBase):
            return BlockQuantMethod(self.linear_format)
        return None


def dequantized_dtype(activations: torch.dtype) -> torch.dtype:
    """The dtype of a quantized layer's float copy: the activations' (`dtype`; bfloat16 under `auto` on a CPU with
    bfloat16 dot products), except bfloat16 on a CPU without them (cpu_multiplies_bf16), where the copy is float32
    and x is upcast, as float bfloat16 layers do there. float32 activations (`dtype: float32`, or `auto` without
    bfloat16 instructions) keep a float32 copy: a bfloat16 one under float32 activations would round x to 8 bits,
    off float32's results by more than the float32 parity tests allow."""
    native = activations == torch.bfloat16 and model_info.cpu_multiplies_bf16()
    return torch.bfloat16 if native else torch.float32


def _name(fmt: BlockFormat | None) -> str:
    return fmt.name if fmt is not None else "float"


def _describe(loaded: Any) -> str:
    if isinstance(loaded, QuantizedTensor):
        return f"checkpoint tensor {loaded.name} ({loaded.type_name})"
    return f"a float checkpoint tensor of shape {tuple(loaded.shape)}"
