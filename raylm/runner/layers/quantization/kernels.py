"""The matmul on weights kept in ggml block formats: raylm's CPU kernels (`runner/csrc/quant/block_gemm.cpp`), built
once per machine like the other CPU kernels, or a dequantize-per-call path (plain torch) everywhere else.

On CPU in float32 a batch of up to MAX_DIRECT_ROWS rows decodes each block of 32 weights in registers, once for all
rows, and multiplies the integers by x directly; a larger batch decodes panels of 16 weight rows to float32 in L1 and
multiplies them by x packed in columns, 16 rows a register (`csrc/quant/float_panels.h`). For bfloat16 activations
on a CPU with AMX-BF16, `amx_linear` decodes panels of 32 weight rows to bfloat16 in cache and multiplies them on AMX
tiles; on one with AVX512-BF16, `bf16_linear` decodes blocks to bfloat16 for its dot products (vdpbf16ps):
candidates of the GEMM plan beside the block kernel. For bfloat16 activations `int8_linear`, llama.cpp's scheme for
few rows, is another: x quantized to int8 per block of 32 once per call, integer dot products against the blocks'
integers (AVX512-VNNI, AVX-VNNI or AVX2; `csrc/quant/int8_dot.h`); its rounding is of bfloat16's order, so float32
activations keep the exact kernels. torch's own weight-only ops (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`)
were slower than both on the CPUs measured (scripts/bench_quant_kernels.py), so they are not used.

On CUDA, where triton is installed, `triton_block_gemm` multiplies x by the blocks as they lie in device memory, each
tile of W decoded in registers (float32, bfloat16 and float16 x). The dequantize-per-call path (CUDA without triton,
other dtypes, `custom_ops="none"`) keeps the weights packed in memory and makes a float copy of one layer's weight per
call: correct everywhere, fast nowhere.
"""
from __future__ import annotations

from functools import cache
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from raylm.runner import cpu_kernels
from raylm.runner.layers.quantization.ggml_blocks import BlockFormat, dequantize

_SOURCES = Path(__file__).resolve().parents[2] / "csrc" / "quant"
# Batches of up to this many rows decode blocks in registers; larger ones decode panels. On a 2-core EPYC (Zen 4) the
# direct kernel ran 1.2-2.5x panels up to 8 rows, the two met at 12, and panels won from 16 (1.2-1.5x).
MAX_DIRECT_ROWS = 12


# Builds that take a narrower instruction set's path than this CPU's (the last -march wins over -march=native), for
# the tests and benchmarks: an AVX2-only CPU's (the integer dot products by vpmaddubsw) and one with AVX-VNNI but no
# AVX-512 (a client core's).
ISA_BUILDS = {"avx2": ("-march=haswell",), "avx_vnni": ("-march=haswell", "-mavxvnni")}


@cache
def load(portable: bool = False, isa: str | None = None) -> ModuleType | None:
    """The compiled kernels, or None (one warning) where they cannot be built. `portable`: a separate build that
    takes the plain-loop path a CPU without AVX2 + FMA runs, whatever this CPU has (the tests check it); `isa`: one of
    ISA_BUILDS, which this CPU must be able to run."""
    flags = ("-DRAYLM_PORTABLE_KERNELS",) if portable else ISA_BUILDS[isa] if isa is not None else ()
    kind = "quant_kernels_portable" if portable else f"quant_kernels_{isa}" if isa is not None else "quant_kernels"
    return cpu_kernels.load_extension(
        kind, sorted(_SOURCES.glob("*.[ch]*")), "block_gemm.cpp",
        "raylm: building the quantized matmul kernels (once per machine, ~20 s)...", extra_cflags=flags)


def kernels_for(device: torch.device, dtype: torch.dtype) -> ModuleType | None:
    """The CPU kernels where they run activations of `dtype` on `device` (float32 on CPU, built, custom ops on)."""
    if not cpu_kernels.is_enabled() or device.type != "cpu" or dtype != torch.float32:
        return None
    return load()


def amx_kernels_for(device: torch.device, dtype: torch.dtype) -> ModuleType | None:
    """The kernels where their AMX path runs activations of `dtype` on `device`: bfloat16 on a CPU whose tiles the
    build targets and the OS lets this process use (`amx_available`), custom ops on."""
    if not cpu_kernels.is_enabled() or device.type != "cpu" or dtype != torch.bfloat16:
        return None
    ops = load()
    return ops if ops is not None and ops.amx_available() else None


def bf16_dot_kernels_for(device: torch.device, dtype: torch.dtype) -> ModuleType | None:
    """The kernels where their bfloat16 dot-product path runs activations of `dtype` on `device`: bfloat16 on a CPU
    whose build has AVX512-BF16 (`bf16_dot_available`), custom ops on."""
    if not cpu_kernels.is_enabled() or device.type != "cpu" or dtype != torch.bfloat16:
        return None
    ops = load()
    return ops if ops is not None and ops.bf16_dot_available() else None


def int8_kernels_for(device: torch.device, dtype: torch.dtype) -> ModuleType | None:
    """The kernels where their integer path runs activations of `dtype` on `device`: bfloat16 on CPU (float32
    activations keep exact products), built, custom ops on."""
    if not cpu_kernels.is_enabled() or device.type != "cpu" or dtype != torch.bfloat16:
        return None
    return load()


def int8_linear(x: torch.Tensor, packed: torch.Tensor, fmt: BlockFormat, bias: torch.Tensor | None,
                ops: ModuleType) -> torch.Tensor:
    """y = x W^T (+ bias) with x quantized to int8 per block (int8_activations) against W's blocks in integer dot
    products, summed in float32, the bias added there; y in x's dtype."""
    y = ops.block_gemm_int8(x if x.dim() == 2 else x.reshape(-1, x.shape[-1]), packed, fmt.ggml_type, packed.shape[0],
                            bias)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], packed.shape[0])


def amx_linear(x: torch.Tensor, packed: torch.Tensor, fmt: BlockFormat, bias: torch.Tensor | None,
               ops: ModuleType) -> torch.Tensor:
    """y = x W^T (+ bias) for bfloat16 x on AMX tiles: each panel of W's blocks decoded to bfloat16 in cache, the
    products summed in float32, y rounded to bfloat16 once (`csrc/quant/amx_gemm.h`)."""
    x2d = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()
    y = ops.block_gemm_amx(x2d, packed, fmt.ggml_type, packed.shape[0], None if bias is None else bias.float())
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], packed.shape[0])


def bf16_linear(x: torch.Tensor, packed: torch.Tensor, fmt: BlockFormat, bias: torch.Tensor | None,
                ops: ModuleType) -> torch.Tensor:
    """y = x W^T (+ bias) for bfloat16 x by AVX512-BF16's dot products on W's blocks decoded to bfloat16 once per
    call, the products summed in float32, y rounded to bfloat16 once (`csrc/quant/bf16_gemm.h`)."""
    x2d = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()
    y = ops.block_gemm_bf16(x2d, packed, fmt.ggml_type, packed.shape[0], None if bias is None else bias.float())
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], packed.shape[0])


@cache
def _triton_gemm() -> ModuleType | None:
    """triton_block_gemm where triton (an optional extra) is installed, else None; imported on the first CUDA call."""
    try:
        from raylm.runner.layers.quantization import triton_block_gemm
    except ImportError:
        return None
    return triton_block_gemm


def triton_gemm_for(device: torch.device, dtype: torch.dtype) -> ModuleType | None:
    """The Triton block kernel where it runs activations of `dtype` on `device` (CUDA, triton installed, custom ops
    on), else None."""
    if device.type != "cuda" or not cpu_kernels.is_enabled():
        return None
    gemm = _triton_gemm()
    return gemm if gemm is not None and dtype in gemm.DTYPES else None


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x [m, k] as int8_linear multiplies it, in float64: quantized per block of 32 as ggml's Q8_0 (scale d =
    max |x| / 127, q = round(x / d) half to even, in float32), times its scale. The reference its tests check."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.round(blocks * torch.where(d > 0, 1 / d, 0))
    return (q.double() * d.double()).reshape(x.shape)


_UNSET = object()


def block_linear(x: torch.Tensor, packed: torch.Tensor, fmt: BlockFormat, bias: torch.Tensor | None,
                 ops: ModuleType | None | object = _UNSET, max_direct_rows: int = MAX_DIRECT_ROWS) -> torch.Tensor:
    """y = x W^T (+ bias) with W [N, K] in `fmt`'s blocks (uint8 [N, fmt.row_bytes(K)]). `ops`: the kernels_for
    decision when the caller made it once (a layer, at load), else made here."""
    if ops is _UNSET:
        ops = kernels_for(x.device, x.dtype)
    if ops is None:
        gemm = triton_gemm_for(x.device, x.dtype)
        if gemm is not None:
            return gemm.block_linear(x, packed, fmt, bias)
        return F.linear(x, dequantize(packed, fmt).to(x.dtype), bias)
    x2d = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()
    # ops is the kernels' module here (_UNSET replaced, None returned): the sentinel makes its type `object`.
    y = ops.block_gemm(x2d, packed, fmt.ggml_type, packed.shape[0], max_direct_rows)  # type: ignore[attr-defined]
    if bias is not None:
        y += bias
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], packed.shape[0])


def block_rows(packed: torch.Tensor, ids: torch.Tensor, fmt: BlockFormat, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of W as `dtype` (an embedding lookup on a quantized table)."""
    flat = ids.reshape(-1)
    ops = kernels_for(packed.device, torch.float32)  # decoded to float32, then cast: exact for any float dtype
    rows = (dequantize(packed[flat], fmt) if ops is None
            else ops.block_dequantize(packed, flat.to(torch.int64).contiguous(), fmt.ggml_type,
                                      packed.shape[1] // fmt.type_bytes * 32))
    return rows.to(dtype).reshape(*ids.shape, -1)
