"""The GEMM plan of a model's linears on CPU: per weight shape, the kernel of runner/layers/cpu_gemm.py (KERNELS)
that ran fastest at each row bucket on this machine.

Which kernel wins depends on the CPU, the shape and the rows of the batch: on one 2-core EPYC oneDNN ran 1.5-3x sgemm
from 8 rows on the 107M model's shapes, yet lost to it by 2x on a 256 x 256 weight below 32 rows. So after loading,
`plan_linears` gives every weight shape of the model a GemmPlan, one kernel per row bucket, by timing the kernels
with the threads the worker runs with. Small batches are timed over as many of the shape's layers as it takes to
outgrow the CPU's caches, since a decode step streams each weight from memory once: timed on one cache-resident
weight, sgemm at one row looked as fast as oneDNN, yet ran at half its speed from memory. Plans are kept in the
user cache per machine (CPU features, torch, threads, shapes): every process on the machine picks the same kernels (so
rounds alike) and a later start-up does not measure again. Delete `~/.cache/raylm/gemm_plans` to measure anew.
A quantized layer is timed on its block kernels, and on the float kernels only where it keeps a dequantized copy.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from raylm.common.logger import show_info
from raylm.configs.cache import build_once, cache_path, content_key
from raylm.runner.cpu_kernels import cpu_flags
from raylm.runner.layers import cpu_gemm
from raylm.runner.layers.cpu_gemm import KERNELS, ROW_BUCKETS, CpuGemmMixin, GemmPlan, skinny_ops

logger = logging.getLogger(__name__)

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
    if torch.bfloat16 in dtypes and not cpu_gemm.onednn_packs(torch.bfloat16):
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
        # Timed only for quantized layers, each of which has its block_matmul (and its amx_matmul, bf16_matmul where
        # the CPU has AMX, AVX512-BF16).
        calls["packed"] = lambda layer, weight, packed, skinny: layer.block_matmul(x, bias)  # type: ignore[misc]
        if layers[0].amx_matmul is not None:
            calls["amx"] = lambda layer, weight, packed, skinny: layer.amx_matmul(x, bias)  # type: ignore[misc]
        if layers[0].bf16_matmul is not None:
            calls["packed_bf16"] = lambda layer, weight, packed, skinny: layer.bf16_matmul(x, bias)  # type: ignore[misc]
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
