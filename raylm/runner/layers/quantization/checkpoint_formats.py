"""`quantization: compressed-tensors | gptq | awq`: a checkpoint quantized as shipped (configs/quant_formats.py reads
its scheme) runs through the block kernels of BlockQuantMethod, in the same timed GEMM plan as `int4` / `gguf`.

Each linear's checkpoint tensors are repacked into Q4_0 / Q4_1 / Q8_0 blocks at load, FP8 weights into raylm's
F8_E4M3 blocks (checkpoint_repack.py), so TP shards them as it shards a GGUF file's blocks (rows for column parallel,
whole blocks for row parallel). Besides:
- activation order (GPTQ desc_act, compressed-tensors actorder group): the weight's input channels were permuted
  into group order at load; x is permuted the same way before the kernel (one index_select per layer call).
- W8A8 int8 and FP8 with dynamic per-token activations: x is quantized and dequantized per token, as
  compressed-tensors computes it (scale = max |x| / (q_max - q_min) * 2, rounded to int8 or cast to FP8), then
  multiplied in float: the same numbers an int8 / FP8 GEMM would sum. FP8 weights stay one byte a weight in their
  F8_E4M3 blocks, which the block kernels decode to exact float32 E4M3 values (bfloat16 on AMX tiles); the
  int8-dot kernel (`packed_int8`) is never planned for them, its integer products cannot take E4M3 values.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from raylm.configs.quant_formats import CheckpointQuant
from raylm.runner.layers.linear import LinearBase, WeightLoader
from raylm.runner.layers.quantization import kernels
from raylm.runner.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from raylm.runner.layers.quantization.block_quant import BlockQuantMethod
from raylm.runner.layers.quantization.checkpoint_repack import RepackedTensor
from raylm.runner.layers.quantization.ggml_blocks import QuantizedTensor

# q_max - q_min of each activation type over 2 (compressed-tensors' calculate_qparams for symmetric args).
_HALF_RANGE = {"int8": 127.5, "fp8": 448.0}
_KINDS = {"int8": 0, "fp8": 1}  # the kernel's numbers


def quantize_activations(x: torch.Tensor, kind: str) -> torch.Tensor:
    """x quantized per token (last dimension) to `kind` and back, as compressed-tensors' dynamic token strategy does:
    in one call of the CPU kernels (`csrc/quant/activation_quant.h`, bit for bit these torch ops) where they run."""
    ops = kernels.kernels_for(x.device, torch.float32)
    if ops is not None and x.dtype in (torch.float32, torch.bfloat16):
        return ops.quantize_activations(x, _KINDS[kind])
    return reference_quantize_activations(x, kind)


def reference_quantize_activations(x: torch.Tensor, kind: str) -> torch.Tensor:
    """quantize_activations in torch ops, in x's dtype: on other devices and dtypes, and the kernel's reference."""
    scale = x.abs().amax(dim=-1, keepdim=True) / _HALF_RANGE[kind]
    scale = torch.where(scale == 0, torch.finfo(x.dtype).eps, scale)
    if kind == "int8":
        q = torch.round((x / scale).clamp(-128, 127))
    else:
        q = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype)
    return q * scale


class CheckpointQuantMethod(BlockQuantMethod):
    """BlockQuantMethod over the blocks a checkpoint's tensors were repacked into (each tensor's own format, as
    under `gguf`), plus the format's input permutation and activation quantization. Its weights stay in their
    blocks alone, run by the block kernels only: a checkpoint is shipped quantized to be held at its quantized size,
    and a float copy beside the blocks (2 or 4 bytes a weight) would hold more than the float checkpoint
    (docs/quantization-formats.md has what it costs in speed)."""

    keeps_float_copy = False

    def __init__(self, quant: CheckpointQuant) -> None:
        super().__init__(None)
        self.quant = quant

    def load_weight(self, layer: Any, param: nn.Parameter, loaded: torch.Tensor | QuantizedTensor,
                    shard_id: object, weight_loader: WeightLoader) -> None:
        """As BlockQuantMethod's, keeping the input permutation of the first part of a fused layer: the others share
        its input, so they must be in the same order."""
        perm = loaded.input_perm if isinstance(loaded, RepackedTensor) else None
        perm = None if perm is None else perm.to(param.device)
        if param.numel() == 0:
            layer.input_perm = perm
        elif not _same_order(perm, getattr(layer, "input_perm", None)):
            name = loaded.name if isinstance(loaded, QuantizedTensor) else "a float checkpoint tensor"
            raise ValueError(f"quantization {self.quant.method!r}: checkpoint tensor {name} orders its input "
                             "channels (g_idx) unlike the other parts of its fused layer, which share their input; "
                             "raylm runs one order per layer")
        super().load_weight(layer, param, loaded, shard_id, weight_loader)

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        perm = getattr(layer, "input_perm", None)  # set by the first loaded part (None: input order)
        if perm is not None:
            x = x.index_select(-1, perm)
        if self.quant.activations is not None:
            x = quantize_activations(x, self.quant.activations)
        return super().apply(layer, x, bias)

    def kernel_name(self, layer: Any) -> str:
        name = super().kernel_name(layer)
        return name if name == "planned" else f"{name} ({self.quant.method})"  # a planned one shows on the plan line

    def changes_input(self, layer: Any) -> bool:
        return getattr(layer, "input_perm", None) is not None or self.quant.activations is not None


def _same_order(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


class CheckpointQuantConfig(QuantizationConfig):
    """Every linear layer (not the embedding or LM head, which these checkpoints keep float) by the checkpoint's
    scheme; a linear the checkpoint stores float (an `ignore`d one) loads float into the same method."""

    def __init__(self, quant: CheckpointQuant) -> None:
        self.name = quant.method
        self.quant = quant

    def get_quant_method(self, layer: nn.Module) -> QuantizeMethodBase | None:
        return CheckpointQuantMethod(self.quant) if isinstance(layer, LinearBase) else None
