"""Linear layers on CPU: for each weight shape and batch size, the kernel that measured fastest on this machine.
(Over 300 lines: the plan, its timing and the layer that follows it are one decision; the kernels are elsewhere.)

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
Which one wins depends on the CPU, the shape and the rows of the batch: on one 2-core EPYC oneDNN ran 1.5-3x sgemm
from 8 rows on the 107M model's shapes, yet lost to it by 2x on a 256 x 256 weight below 32 rows. So after loading,
`plan_linears` gives every weight shape of the model a GemmPlan, one kernel per row bucket, by timing the kernels
with the threads the worker runs with. Small batches are timed over as many of the shape's layers as it takes to
outgrow the CPU's caches, since a decode step streams each weight from memory once: timed on one cache-resident
weight, sgemm at one row looked as fast as oneDNN, yet ran at half its speed from memory. Plans are kept in the
user cache per machine (CPU features, torch, threads, shapes): every process on the machine picks the same kernels (so
rounds alike) and a later start-up does not measure again. Delete `~/.cache/raylm/gemm_plans` to measure anew.

A block-quantized layer (quantization: int8, int4, gguf) plans the same way with its own kernels on the packed weight:
`packed` (blocks decoded in registers, fastest at a few rows where reading fewer bytes is what counts) and, for bfloat16
activations, `packed_int8` (llama.cpp's few-row scheme: x quantized to int8 per block, integer dot products with the
blocks' integers, up to _COLD_MAX_ROWS rows) and, on a CPU with AMX, `amx` (panels decoded to bfloat16 in cache for
AMX's tile products). Where AMX runs, the block kernels are the only candidates and the weight stays in its blocks
alone: on a Sapphire Rapids core the AMX kernel ran 0.9-1.3x oneDNN's bfloat16 matmul on a dequantized copy from 64 to
512 rows. Elsewhere the float kernels are candidates too, on a dequantized copy of the weight (`dequantized`, in the
activations' dtype; see quantization.block_quant), kept only where the plan picks them for some bucket
(docs/cpu-performance.md).
"""
from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from raylm.common.logger import show_info
from raylm.configs.cache import build_once, cache_path, content_key
from raylm.runner import cpu_kernels
from raylm.runner.cpu_kernels import cpu_flags
from raylm.runner.layers.quantization import kernels

logger = logging.getLogger(__name__)

# The rows timed; a batch of n rows takes the kernel of the first bucket >= n (of the last beyond it).
ROW_BUCKETS = tuple(2**i for i in range(11))  # 1, 2, 4, ..., 1024
_TIMED_ROUNDS = 5
# Past this many FLOPs per call both kernels are compute-bound: larger buckets take the last timed choice, which
# keeps the start-up cost of a big model's shapes to seconds.
_MAX_TIMED_FLOPS = 4e9
# Up to this many rows a kernel is memory-bound: it is timed over enough layers' weights to fill _COLD_BYTES, more than
# a server CPU's last-level cache holds, so each call reads its weight from memory as in a real step.
_COLD_MAX_ROWS = 16
_COLD_BYTES = 96 * 2**20
# The skinny kernel is timed up to this many rows: past the memory-bound sizes its passes of up to 12 rows (4 with AVX2)
# still beat oneDNN on a 2-core EPYC at 32-64 rows (SmolLM2's shapes, with 8-row passes: 215-232 against 153-216
# GFLOP/s); from 128 rows on, they were even.
_SKINNY_MAX_ROWS = 128

Shape = tuple[int, int, bool, str]  # (out_features, in_features, has_bias, weight: its dtype or block format)


FLOAT_KERNELS = ("sgemm", "onednn", "skinny")
# A block-quantized layer's own kernels: `packed` decodes blocks in registers (float32), `packed_int8` multiplies int8 x
# by the blocks' integers (bfloat16 activations), `amx` decodes panels to bfloat16 for AMX's tile products (bfloat16
# activations on a CPU with AMX-BF16).
BLOCK_KERNELS = frozenset({"packed", "packed_int8", "amx"})
KERNELS = (*FLOAT_KERNELS, "packed", "packed_int8", "amx")


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
    dequantized: torch.Tensor | None = None
    params_dtype: torch.dtype  # a quantized layer's activations (the model's dtype), set with block_matmul

    def gemm_weight(self) -> torch.Tensor:
        """The float weight the float kernels run on: the dequantized copy of a quantized layer, else the weight."""
        return self.dequantized if self.dequantized is not None else self.weight

    def gemm_shape(self) -> tuple[int, int]:
        """(out_features, in_features) of the product, whatever form the weight is kept in."""
        if self.block_matmul is not None and self.dequantized is None:
            return self.weight.shape[0], int(self.in_features_per_partition)
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
        fmt = getattr(self.weight, "quant_format", None)
        int8 = None if self.block_matmul is None else kernels.int8_kernels_for(self.weight.device, self.params_dtype)
        self.int8_matmul = None if int8 is None else (
            lambda x, bias: kernels.int8_linear(x, self.weight, fmt, bias, int8))
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


def plan_linears(model: nn.Module) -> None:
    """Give every packed layer of `model` the plan of its shape, from the user cache or timed now (one line says
    so), and drop the packed copies of shapes whose plan never uses oneDNN."""
    layers: dict[Shape, list[CpuGemmMixin]] = {}
    for module in model.modules():
        # Float weights oneDNN packed, and quantized ones (with or without a float copy): their kernels are timed.
        if isinstance(module, CpuGemmMixin) and (module.packed_weight is not None or module.block_matmul is not None):
            out_features, in_features = module.gemm_shape()
            shape = (out_features, in_features, module.bias is not None, module.weight_kind())
            layers.setdefault(shape, []).append(module)
    unplanned = sorted({m.kernel_name() for m in model.modules() if isinstance(m, CpuGemmMixin)} - {"planned"})
    if unplanned:
        show_info(logger)
        logger.info("cpu linear kernels: %s%s", ", ".join(unplanned), _why_not_onednn(model))
    if not layers:
        return
    threads, shapes = torch.get_num_threads(), sorted(layers)
    kinds = sorted({shape[3] for shape in shapes})
    # The kernels' builds (named by their sources' hash), so that a changed skinny or block kernel is timed again.
    builds = sorted({str(getattr(ops, "__name__", None)) for group in layers.values()
                     for ops in (skinny_ops(group[0].gemm_weight()), getattr(group[0], "block_kernels", None))})
    key = content_key("gemm_plans", repr(shapes), str(kinds), str(threads), cpu_flags(), torch.__version__,
                      repr(ROW_BUCKETS), f"cold {_COLD_MAX_ROWS} rows {_COLD_BYTES}", f"kernels {KERNELS}",
                      f"builds {builds}, skinny up to {_SKINNY_MAX_ROWS} rows", sys.implementation.cache_tag)
    folder = cache_path("gemm_plans", key)

    def time_into(tmp: Path) -> dict[Shape, GemmPlan]:
        plans, figures = {}, {}
        for shape in shapes:
            plans[shape], figures[f"{shape[0]}x{shape[1]} {shape[3]}"] = time_kernels(layers[shape])
        (tmp / "plans.json").write_text(json.dumps({
            "weights": kinds, "threads": threads, "row_buckets": ROW_BUCKETS, "gflops": figures,
            "plans": [[*shape, plans[shape].kernels] for shape in shapes]}))
        return plans

    plans = build_once(folder, time_into, f"raylm: timing the CPU linear kernels for {len(shapes)} weight shapes "
                                          f"({threads} threads; once per machine, a few seconds)...")
    if plans is None:
        saved = json.loads((folder / "plans.json").read_text())["plans"]
        plans = {(out_f, in_f, bias, kind): GemmPlan(tuple(kernels)) for out_f, in_f, bias, kind, kernels in saved}
    for shape, planned in layers.items():
        for layer in planned:
            layer.gemm_plan = plans[shape]
            layer.process_weights_after_loading()
    show_info(logger)
    logger.info("cpu linear kernels (%d threads): %s", threads,
                "; ".join(f"{out_f}x{in_f}{'' if kind in ('float32', 'bfloat16') else f' ({kind})'}: "
                          f"{plans[(out_f, in_f, b, kind)].describe()}" for out_f, in_f, b, kind in shapes))


def _why_not_onednn(model: nn.Module) -> str:
    dtypes = {m.weight.dtype for m in model.modules() if isinstance(m, CpuGemmMixin) and m.block_matmul is None}
    if torch.bfloat16 in dtypes and not onednn_packs(torch.bfloat16):
        return (" (bfloat16 weights upcast to float32 once: oneDNN's bfloat16 kernels need AVX-512 BW/VL/DQ or "
                f"AVX-NE-CONVERT, and this CPU has {torch.backends.cpu.get_cpu_capability()})")
    return ""


def time_kernels(layers: list[CpuGemmMixin]) -> tuple[GemmPlan, dict[str, list[float]]]:
    """Times the kernels on the layers' weights (all of one shape) at every row bucket, their calls interleaved
    (best of _TIMED_ROUNDS each; skinny up to _SKINNY_MAX_ROWS rows, where it applies); returns the plan and the
    GFLOP/s of each kernel per bucket timed."""
    weight = layers[0].gemm_weight()
    out_features, in_features = layers[0].gemm_shape()
    bias = None if layers[0].bias is None else torch.zeros_like(layers[0].bias)
    # Enough layers that the smallest form of the weight (a quantized layer's blocks) outgrows the caches.
    weight_bytes = min(w.numel() * w.element_size() for w in (weight, layers[0].weight))
    num_cold = min(len(layers), -(-_COLD_BYTES // weight_bytes))
    float_weight = layers[0].block_matmul is None or layers[0].dequantized is not None
    ops = skinny_ops(weight) if float_weight else None
    # Packed once for every bucket that times them (up to _COLD_BYTES of them for the cold small ones).
    skinny = None if ops is None else [ops.pack_skinny(layer.gemm_weight().detach()) for layer in layers[:num_cold]]
    # x as the layer receives it: a quantized layer's activations may differ from its copy's dtype (block_quant).
    x_dtype = layers[0].params_dtype if layers[0].block_matmul is not None else weight.dtype
    choices: list[str] = []
    figures: dict[str, list[float]] = {name: [] for name in KERNELS}
    for rows in ROW_BUCKETS:
        flops = 2.0 * rows * out_features * in_features
        if choices and flops > _MAX_TIMED_FLOPS:
            choices.append(choices[-1])
            continue
        num_timed = num_cold if rows <= _COLD_MAX_ROWS else 1
        best = _best_seconds(torch.randn(rows, in_features, dtype=x_dtype), layers[:num_timed], bias,
                             skinny[:num_timed] if skinny is not None and rows <= _SKINNY_MAX_ROWS else None)
        for name, seconds in best.items():
            figures[name].append(round(flops / seconds / 1e9, 1))
        choices.append(min(best, key=best.__getitem__))
    return GemmPlan(tuple(choices)), {name: rates for name, rates in figures.items() if rates}


def _best_seconds(x: torch.Tensor, layers: list[CpuGemmMixin], bias: torch.Tensor | None,
                  skinny: list[torch.Tensor] | None) -> dict[str, float]:
    """Seconds per call of each kernel, over the layers' weights in turn; the skinny kernel too where `skinny` holds
    the layers' panels."""
    ops = None if skinny is None else skinny_ops(layers[0].gemm_weight())
    out_features, dtype = layers[0].gemm_shape()[0], layers[0].gemm_weight().dtype
    weights = [(layer, layer.gemm_weight(), layer.packed_weight, None if skinny is None else skinny[i])
               for i, layer in enumerate(layers)]
    quantized = layers[0].block_matmul is not None
    # A quantized layer's float kernels take x cast to its copy's dtype and give back x's, as CpuGemmMixin.matmul.
    cast_in, cast_out = (lambda: x.to(dtype)), (lambda y: y.to(x.dtype) if quantized else y)
    float_bias = None if bias is None else bias.to(dtype)
    Call = Callable[[CpuGemmMixin, torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor]
    calls: dict[str, Call] = {}
    if not quantized or layers[0].dequantized is not None:  # a float weight, or a quantized one's float copy
        calls["sgemm"] = lambda layer, weight, packed, skinny: cast_out(F.linear(cast_in(), weight, float_bias))
        calls["onednn"] = lambda layer, weight, packed, skinny: cast_out(
            torch.ops.mkldnn._linear_pointwise(cast_in(), packed, float_bias, "none", [], ""))
    if ops is not None:
        calls["skinny"] = lambda layer, weight, packed, skinny: cast_out(
            ops.skinny_linear(cast_in(), skinny, out_features, float_bias))
    if quantized:
        # Timed only for quantized layers, each of which has its block_matmul (and its amx_matmul where AMX runs).
        calls["packed"] = lambda layer, weight, packed, skinny: layer.block_matmul(x, bias)  # type: ignore[misc]
        if layers[0].amx_matmul is not None:
            calls["amx"] = lambda layer, weight, packed, skinny: layer.amx_matmul(x, bias)  # type: ignore[misc]
        if layers[0].int8_matmul is not None and x.shape[0] <= _COLD_MAX_ROWS:  # a few-row kernel
            calls["packed_int8"] = lambda layer, weight, packed, skinny: layer.int8_matmul(x, bias)  # type: ignore[misc]
    best = {name: float("inf") for name in calls}
    for round_index in range(_TIMED_ROUNDS + 1):
        for name, call in calls.items():
            start = time.perf_counter()
            for layer, weight, packed, panel in weights:
                call(layer, weight, packed, panel)
            if round_index:  # round 0 warms up: oneDNN creates its primitive, the caches fill
                best[name] = min(best[name], (time.perf_counter() - start) / len(weights))
    return best
