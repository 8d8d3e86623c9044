"""Linear layers on CPU: the kernels a linear may run and the layer that follows its GEMM plan (gemm_plans.py times
them per weight shape and batch size on this machine).

Three kernels compute y = x W^T (+ b), summing in float32: `sgemm`, torch's F.linear on the weight as stored (MKL's
or OpenBLAS's sgemm; oneDNN's for bfloat16); `onednn`, oneDNN's matmul on a copy of the weight reordered once into its
blocked layout (bfloat16 through AMX or AVX512-BF16 where the CPU has them); and, for batches of up to 128 rows with
raylm's CPU kernels, `skinny` (runner/csrc/skinny_gemm.h) on a copy packed into panels that stream from memory in one
run, each load feeding every row: on a 2-core EPYC it read the weights of SmolLM2's shapes at 1.3-1.9x oneDNN's rate
from 1 to 8 rows. A bfloat16 weight's panels are half the bytes, their pairs multiplied by AVX512-BF16's dot products
where the kernels' build has them, else widened to float32 first.
oneDNN packs bfloat16 weights only on CPUs with the instructions its bf16 kernels need (AVX-512 BW/VL/DQ or
AVX-NE-CONVERT; torch asks oneDNN); elsewhere a bfloat16 layer keeps a float32 copy of its weight, upcast once, and
runs `sgemm_fp32` (x upcast, sgemm, the result cast back), 3-5x torch's own bfloat16 linear on an AVX2-only CPU.
Which one wins depends on the CPU, the shape and the rows of the batch, so each weight shape gets a GemmPlan, one kernel
per row bucket, timed on this machine (gemm_plans.py).

A block-quantized layer (quantization: int8, int4, gguf, and the checkpoint formats) has its own kernels on the packed
weight: `packed` (blocks decoded in registers, fastest at a few rows where reading fewer bytes is what counts) and, for
bfloat16 activations, `packed_int8` (llama.cpp's few-row scheme: x quantized to int8 per block, integer dot products
with the blocks' integers) and, on a CPU with AMX, `amx` (panels decoded to bfloat16 in cache for AMX's tile
products). Where AMX runs, the block kernels are the only candidates and the weight stays in its blocks alone.
Elsewhere the float kernels are candidates too, on a dequantized copy of the weight (`dequantized`, in the
activations' dtype; see quantization.block_quant), kept only where the plan picks them for some bucket
(docs/cpu-performance.md).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from raylm.runner import cpu_kernels

# The rows timed; a batch of n rows takes the kernel of the first bucket >= n (of the last beyond it).
ROW_BUCKETS = tuple(2**i for i in range(11))  # 1, 2, 4, ..., 1024

FLOAT_KERNELS = ("sgemm", "onednn", "skinny")
# A block-quantized layer's own kernels: `packed` decodes blocks in registers (float32), `packed_int8` multiplies int8 x
# by the blocks' integers (bfloat16 activations), `amx` decodes panels to bfloat16 for AMX's tile products and
# `packed_bf16` decodes blocks to bfloat16 for AVX512-BF16's dot products (bfloat16 activations on a CPU with them).
BLOCK_KERNELS = frozenset({"packed", "packed_int8", "amx", "packed_bf16"})
KERNELS = (*FLOAT_KERNELS, "packed", "packed_int8", "amx", "packed_bf16")


@dataclass(frozen=True)
class GemmPlan:
    """The kernel per row bucket of one weight shape, one of KERNELS."""

    kernels: tuple[str, ...]  # one entry per ROW_BUCKETS

    def __post_init__(self) -> None:
        assert set(self.kernels) <= set(KERNELS), self.kernels

    def kernel_for(self, rows: int) -> str:
        # Bucket i holds the rows in (2**(i-1), 2**i].
        return self.kernels[min((max(rows, 1) - 1).bit_length(), len(self.kernels) - 1)]

    def describe(self) -> str:
        """E.g. "skinny up to 8 rows, then sgemm up to 16 rows, then onednn"."""
        names = self.kernels
        parts = [names[0]]
        for i in range(1, len(names)):
            if names[i] != names[i - 1]:
                rows = ROW_BUCKETS[i - 1]
                parts.append(f"up to {rows} row{'s' if rows > 1 else ''}, then {names[i]}")
        return " ".join(parts)


class CpuGemmMixin:
    """A layer whose `weight` [out, in] (and `bias`) run through the plan's kernels on CPU."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    packed_weight: torch.Tensor | None = None  # oneDNN's copy, where the plan uses it
    skinny_weight: torch.Tensor | None = None  # the skinny kernel's panels, where the plan uses it
    gemm_plan: GemmPlan | None = None  # None until planned: onednn wherever a packed copy exists
    upcast_weight: torch.Tensor | None = None  # float32 copy of a bfloat16 weight oneDNN cannot pack here
    upcast_bias: torch.Tensor | None = None
    # A block-quantized layer's own kernel (`packed` in plans) and its weight's float copy for the float kernels.
    block_matmul: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None
    amx_matmul: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None  # where AMX runs here
    int8_matmul: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None  # bfloat16 activations
    bf16_matmul: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None  # where AVX512-BF16 runs
    dequantized: torch.Tensor | None = None
    params_dtype: torch.dtype  # a quantized layer's activations (the model's dtype), set with block_matmul
    in_features_per_partition: int  # a quantized layer's (its blocks' bytes do not show it), set at creation

    def gemm_weight(self) -> torch.Tensor:
        """The float weight the float kernels run on: the dequantized copy of a quantized layer, else the weight."""
        return self.dequantized if self.dequantized is not None else self.weight

    def gemm_shape(self) -> tuple[int, int]:
        """(out_features, in_features) of the product, whatever form the weight is kept in."""
        if self.block_matmul is not None and self.dequantized is None:
            return self.weight.shape[0], self.in_features_per_partition
        out_features, in_features = self.gemm_weight().shape
        return out_features, in_features

    def weight_kind(self) -> str:
        """The planned weight's dtype, or its block format and its copy's dtype, or the activations' dtype where
        it keeps no copy (plans are kept per kind)."""
        if self.block_matmul is None:
            return str(self.weight.dtype).removeprefix("torch.")
        fmt = getattr(getattr(self.weight, "quant_format", None), "name", "blocks")
        if self.dequantized is None:
            return f"{fmt} blocks only, {str(self.params_dtype).removeprefix('torch.')} activations"
        return f"{fmt} as {str(self.gemm_weight().dtype).removeprefix('torch.')}"

    def process_weights_after_loading(self) -> None:
        """Pack the weight for oneDNN (again after sleep mode's wake-up), unless its plan never uses oneDNN, and for
        the skinny kernel where its plan uses it; or upcast a bfloat16 weight once where oneDNN cannot pack it."""
        weight = self.gemm_weight()
        on_cpu = weight.device.type == "cpu"
        if on_cpu and self.block_matmul is None and weight.dtype == torch.bfloat16 and not onednn_packs(torch.bfloat16):
            self.upcast_weight = self.weight.detach().float()
            self.upcast_bias = None if self.bias is None else self.bias.detach().float()
            return
        plan = self.gemm_plan
        wanted = plan is None or "onednn" in plan.kernels
        self.packed_weight = pack_weight(weight) if wanted and on_cpu and onednn_packs(weight.dtype) else None
        ops = skinny_ops(weight)
        self.skinny_weight = None
        if plan is not None and "skinny" in plan.kernels and ops is not None:
            self.skinny_weight = ops.pack_skinny(weight.detach().contiguous())

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """y = x W^T + bias, by the plan's kernel for x's rows; F.linear where nothing was packed (on a GPU: cuBLAS)."""
        if self.upcast_weight is not None:
            assert bias is None or bias is self.bias, "the upcast path adds the layer's own bias or none"
            return F.linear(x.float(), self.upcast_weight, None if bias is None else self.upcast_bias).to(x.dtype)
        packed, plan = self.packed_weight, self.gemm_plan
        if plan is None:  # unplanned: a quantized layer's block kernel, else oneDNN where packed
            kernel = "packed" if self.block_matmul is not None else "onednn" if packed is not None else "sgemm"
        else:
            kernel = plan.kernel_for(x.shape[0])
        if self.block_matmul is not None:
            if kernel == "amx" and self.amx_matmul is not None and x.dtype == torch.bfloat16:
                return self.amx_matmul(x, bias)
            if kernel == "packed_bf16" and self.bf16_matmul is not None and x.dtype == torch.bfloat16:
                return self.bf16_matmul(x, bias)
            if kernel == "packed_int8" and self.int8_matmul is not None:
                return self.int8_matmul(x, bias)
            if kernel in BLOCK_KERNELS or self.dequantized is None:
                return self.block_matmul(x, bias)
            # The copy's dtype may differ from x's (float32 for bfloat16 activations on a CPU without bfloat16
            # products): cast there and back, the bias added in x's dtype.
            y = self._float_matmul(kernel, x.to(self.dequantized.dtype), None).to(x.dtype)
            return y if bias is None else y.add_(bias)
        return self._float_matmul(kernel, x, bias)

    def _float_matmul(self, kernel: str, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight, packed = self.gemm_weight(), self.packed_weight
        if kernel == "skinny" and self.skinny_weight is not None and x.dim() == 2 and x.stride(-1) == 1:
            ops = cpu_kernels.load()
            assert ops is not None, "a skinny copy exists only where the kernels were built"
            return ops.skinny_linear(x, self.skinny_weight, weight.shape[0], bias)
        if kernel == "onednn" and packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return F.linear(x, weight, bias)

    def kernel_name(self) -> str:
        """The kernel this layer runs on CPU, for the start-up line."""
        if self.upcast_weight is not None:
            return "sgemm_fp32"
        return "planned" if self.packed_weight is not None else "sgemm"


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack and run weights of `dtype` on this CPU: float32 wherever torch has oneDNN; bfloat16
    only where oneDNN's own ISA check passes (torch reports it), since packing raises on other CPUs."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def skinny_ops(weight: torch.Tensor) -> ModuleType | None:
    """raylm's CPU kernels where the skinny kernel applies to this weight (float32 or bfloat16 on a CPU, kernels on),
    else None."""
    return cpu_kernels.ops_for_kind(weight.device, weight.dtype, cpu_kernels.DECODER_DTYPES)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight [out, in] in oneDNN's layout; usable only by the `onednn` kernel."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
