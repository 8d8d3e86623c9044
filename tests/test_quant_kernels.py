"""The block formats and their matmul kernels: quantize/dequantize bit for bit as the gguf package does (ggml's
formats) and as torch.float8_e4m3fn decodes (raylm's F8_E4M3), and the CPU kernels (few rows: blocks decoded in
registers; many rows: panels decoded to float32) and the dequantize-per-call path equal to dequantize-then-matmul,
on odd shapes."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from raylm.runner import cpu_kernels
from raylm.runner.layers.quantization import kernels
from raylm.runner.layers.quantization.checkpoint_formats import reference_quantize_activations
from raylm.runner.layers.quantization.ggml_blocks import (
    F8_E4M3,
    FORMATS,
    BlockFormat,
    dequantize,
    pack_fp8,
    quantize,
)

KERNEL_FORMATS = [*FORMATS.values(), F8_E4M3]  # ggml's and raylm's FP8 blocks
# (rows of x, N, K): panels against one group of x's rows, pairs of them, a short last one, and a second 256-row pass
SHAPES = [(1, 1, 32), (1, 37, 96), (3, 5, 32), (7, 129, 160), (13, 64, 288), (40, 33, 96), (300, 17, 64)]


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator) * torch.logspace(-2, 1, n).unsqueeze(1)
    weight[0, :32] = 0  # a block of zeros: scale 0
    return weight


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=lambda f: f.name)
def test_quantize_and_dequantize_match_gguf(fmt: BlockFormat) -> None:
    weight = _weight(37, 160, seed=1)
    weight[1, 40] = -weight[1, 32:64].abs().max()  # an extreme of either sign in one block
    ours = quantize(weight, fmt)
    theirs = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType(fmt.ggml_type))
    assert np.array_equal(ours.numpy(), theirs)
    assert np.array_equal(dequantize(ours, fmt).numpy(),
                          gguf.quants.dequantize(theirs, gguf.GGMLQuantizationType(fmt.ggml_type)))


def _reference(x: torch.Tensor, packed: torch.Tensor, fmt: BlockFormat, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ dequantize(packed, fmt).double().T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("fmt", KERNEL_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("max_direct_rows", [0, 1 << 20], ids=["panels", "direct"])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
def test_cpu_kernels_equal_dequantize_then_matmul(fmt: BlockFormat, max_direct_rows: int, m: int, n: int,
                                                  k: int) -> None:
    assert kernels.load() is not None, "the quantized kernels did not build"
    packed = quantize(_weight(n, k, seed=n * k), fmt)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(n) if m % 2 else None
    y = kernels.block_linear(x, packed, fmt, bias, kernels.load(), max_direct_rows=max_direct_rows)
    reference = _reference(x, packed, fmt, bias)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    torch.testing.assert_close(y.double(), reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())


@pytest.mark.parametrize("build", ["portable", "avx2"])
@pytest.mark.parametrize("fmt", KERNEL_FORMATS, ids=lambda f: f.name)
def test_narrower_builds_equal_dequantize_then_matmul(fmt: BlockFormat, build: str) -> None:
    """The plain-loop path (CPUs without AVX2 + FMA) and the AVX2 one (8-float registers: panels against 8 rows of
    x a register), built here on purpose although this CPU may have more: both GEMM paths and the row lookup on a
    shape with a partial 4-row group, panels against a pair of row groups and a short one, and more blocks than one
    register set."""
    ops = kernels.load(portable=True) if build == "portable" else kernels.load(isa="avx2")
    assert ops is not None and ops is not kernels.load(), f"the {build} quantized kernels did not build"
    m, n, k = 23, 129, 160
    packed = quantize(_weight(n, k, seed=5), fmt)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(5))
    reference = _reference(x, packed, fmt, None)
    for max_direct_rows in (0, 1 << 20):
        y = kernels.block_linear(x, packed, fmt, None, ops, max_direct_rows=max_direct_rows)
        torch.testing.assert_close(y.double(), reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())
    ids = torch.tensor([128, 0, 5])
    assert torch.equal(ops.block_dequantize(packed, ids, fmt.ggml_type, k), dequantize(packed, fmt)[ids])


AMX_SHAPES = [(1, 32, 32), (5, 37, 96), (16, 64, 576), (17, 96, 160), (40, 33, 64), (70, 130, 288), (100, 700, 96)]


@pytest.mark.parametrize("fmt", KERNEL_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize(("m", "n", "k"), AMX_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in AMX_SHAPES])
def test_amx_path_equals_dequantize_then_matmul_in_bfloat16(fmt: BlockFormat, m: int, n: int, k: int) -> None:
    """The AMX kernel (bfloat16 x, panels of W decoded to bfloat16, float32 sums, y rounded once): one x block and
    pairs of them, panels decoded in groups (the last one short), a last panel and a last x block cut short, with and
    without bias. It computes on the weights the bfloat16 copy holds, so it differs from that product by summation
    order and the final rounding only."""
    ops = kernels.amx_kernels_for(torch.device("cpu"), torch.bfloat16)
    if ops is None:
        pytest.skip("no AMX-BF16 here (the block kernel and the float kernels cover this CPU)")
    packed = quantize(_weight(n, k, seed=n + k), fmt)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    bias = torch.randn(n).bfloat16() if m % 2 else None
    y = kernels.amx_linear(x, packed, fmt, bias, ops)
    copy = dequantize(packed, fmt).bfloat16().double()
    reference = x.double() @ copy.T + (0 if bias is None else bias.double())
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    torch.testing.assert_close(y.double(), reference, rtol=2**-7, atol=2**-7 * reference.abs().max().item())


def test_amx_needs_its_build_and_bfloat16() -> None:
    """The portable build (and any build whose compiler did not target AMX) reports no tiles, so plans never time
    `amx` there; float32 activations never take it."""
    portable = kernels.load(portable=True)
    assert portable is not None and not portable.amx_available()
    assert kernels.amx_kernels_for(torch.device("cpu"), torch.float32) is None


BF16_SHAPES = [(1, 32, 32), (5, 37, 96), (8, 64, 576), (9, 17, 64), (16, 64, 576), (17, 96, 160), (40, 33, 64),
               (70, 130, 288), (300, 40, 96)]


@pytest.mark.parametrize("fmt", KERNEL_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("way", ["direct", "panels"])
@pytest.mark.parametrize(("m", "n", "k"), BF16_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in BF16_SHAPES])
def test_bf16_dot_path_equals_dequantize_then_matmul_in_bfloat16(fmt: BlockFormat, way: str, m: int, n: int,
                                                                  k: int) -> None:
    """The AVX512-BF16 kernel both ways (blocks decoded in registers for every row; panels of 16 decoded rows against
    x packed in pairs: one group of 16 rows and pairs of them, the last short, 256-row passes and a short one), a
    last panel cut short, with and without bias. Like the AMX kernel it multiplies the weights the bfloat16 copy
    holds, so it differs from that product by summation order and the final rounding only."""
    ops = kernels.bf16_dot_kernels_for(torch.device("cpu"), torch.bfloat16)
    if ops is None:
        pytest.skip("no AVX512-BF16 in this build (the block kernel and the float kernels cover this CPU)")
    packed = quantize(_weight(n, k, seed=n + k), fmt)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    bias = torch.randn(n) if m % 2 else None
    y = ops.block_gemm_bf16(x, packed, fmt.ggml_type, n, bias, max_direct_rows=m if way == "direct" else 0)
    copy = dequantize(packed, fmt).bfloat16().double()
    reference = x.double() @ copy.T + (0 if bias is None else bias.double())
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    torch.testing.assert_close(y.double(), reference, rtol=2**-7, atol=2**-7 * reference.abs().max().item())


def test_bf16_dot_needs_its_build_and_bfloat16() -> None:
    """Builds whose compiler did not target AVX512-BF16 (the AVX2 and portable ones, as on a CPU without it) have no
    such kernel and refuse the call by name, so plans never time `packed_bf16` there; float32 activations never
    take it."""
    for build in (kernels.load(portable=True), kernels.load(isa="avx2")):
        assert build is not None and not build.bf16_dot_available()
        with pytest.raises(RuntimeError, match="AVX512-BF16"):
            build.block_gemm_bf16(torch.zeros(1, 32).bfloat16(), quantize(torch.ones(1, 32), F8_E4M3),
                                  F8_E4M3.ggml_type, 1, None, 8)
    assert kernels.bf16_dot_kernels_for(torch.device("cpu"), torch.float32) is None


def test_bf16_kernels_refuse_weights_that_do_not_fit() -> None:
    """A weight of another format or width than the call says, or a bias of the wrong length, is refused by name
    before any product."""
    ops = kernels.bf16_dot_kernels_for(torch.device("cpu"), torch.bfloat16)
    if ops is None:
        pytest.skip("no AVX512-BF16 in this build")
    packed, x = quantize(torch.randn(4, 64), FORMATS["Q4_1"]), torch.zeros(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="do not hold 64 weights of ggml type 8"):
        ops.block_gemm_bf16(x, packed, 8, 4)
    with pytest.raises(RuntimeError, match="do not hold 32 weights"):
        ops.block_gemm_bf16(x[:, :32].contiguous(), packed, 3, 4)
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32 tensor of 4 values"):
        ops.block_gemm_bf16(x, packed, 3, 4, torch.zeros(3))


@pytest.mark.parametrize("build", ["native", "portable", "avx2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_activation_quantization_kernel_equals_torch_ops(kind: str, dtype: torch.dtype, build: str) -> None:
    """W8A8 / FP8 activations quantized and dequantized per token in one kernel call, bit for bit as the torch ops
    compressed-tensors runs (in x's dtype): rows of every magnitude, a zero row, E4M3 subnormals and ties, in this
    CPU's build and the narrower ones."""
    ops = kernels.load(portable=True) if build == "portable" else kernels.load(isa=None if build == "native" else build)
    assert ops is not None
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(40, 96, generator=generator) * torch.logspace(-6, 4, 40).unsqueeze(1)
    x[3] = 0  # a zero row: scale epsilon
    x[5, :8] = torch.tensor([448.0, -448.0, 1e-6, -3e-5, 2.0**-10, 3 * 2.0**-10, 0.5 + 2.0**-5, 300.0])
    x = x.to(dtype)
    ours = ops.quantize_activations(x, {"int8": 0, "fp8": 1}[kind])
    reference = reference_quantize_activations(x, kind)
    assert ours.dtype == dtype and torch.equal(ours, reference), (ours - reference).abs().max()
    batched = ops.quantize_activations(x.reshape(4, 10, 96), {"int8": 0, "fp8": 1}[kind])
    assert torch.equal(batched.reshape(40, 96), reference)


@pytest.mark.parametrize("fmt", KERNEL_FORMATS, ids=lambda f: f.name)
def test_rows_lookup(fmt: BlockFormat) -> None:
    packed = quantize(_weight(37, 96, seed=2), fmt)
    ids = torch.tensor([[3, 0], [36, 3]])
    rows = kernels.block_rows(packed, ids, fmt, torch.float32)
    assert torch.equal(rows, dequantize(packed, fmt)[ids])


def test_dequantize_per_call_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without raylm's kernels (custom_ops none; and every non-CPU device) the layer dequantizes per call."""
    fmt = FORMATS["Q4_1"]
    packed, x = quantize(_weight(33, 96, seed=3), fmt), torch.randn(5, 96)
    cpu_kernels.set_enabled(False)
    assert kernels.kernels_for(x.device, x.dtype) is None
    y = kernels.block_linear(x, packed, fmt, None)
    torch.testing.assert_close(y.double(), _reference(x, packed, fmt, None), rtol=1e-5, atol=1e-5)


def _every_e4m3() -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 values [3, 256], float32 scales [3]): every byte but the two NaNs (0x7F, 0xFF: 0x7E, 0xFE instead)
    subnormals and negatives included, in three orders, under three channel scales."""
    bits = torch.arange(256, dtype=torch.int32)
    bits = torch.where(bits & 0x7F == 0x7F, bits - 1, bits)
    rows = torch.stack([bits, bits.flip(0), bits.roll(37)]).to(torch.uint8)
    return rows.view(torch.float8_e4m3fn), torch.tensor([0.3712, 3.0, 2.0**-6])


def test_f8_e4m3_blocks_hold_the_checkpoint_values() -> None:
    """Each block: the row's float32 scale, then the E4M3 bytes as stored; dequantize gives scale * value as torch
    decodes E4M3. quantize rounds a float row to E4M3 under max |w| / 448."""
    values, scale = _every_e4m3()
    packed = pack_fp8(values, scale)
    assert packed.shape == (3, 8 * 36) and F8_E4M3.row_bytes(256) == 8 * 36
    blocks = packed.reshape(3, 8, 36)
    assert torch.equal(blocks[..., :4].contiguous().view(torch.float32).squeeze(-1), scale[:, None].expand(3, 8))
    assert torch.equal(blocks[..., 4:].reshape(3, 256), values.view(torch.uint8))
    assert torch.equal(dequantize(packed, F8_E4M3), values.float() * scale[:, None])
    weight = _weight(5, 64, seed=6)
    row_scale = weight.abs().amax(1) / 448
    expected = (weight / torch.where(row_scale > 0, row_scale, 1)[:, None]).to(torch.float8_e4m3fn)
    assert torch.equal(quantize(weight, F8_E4M3), pack_fp8(expected, row_scale))


@pytest.mark.parametrize("flush_denormal", [False, True], ids=["denormals", "flush_denormal"])
@pytest.mark.parametrize("build", ["native", "portable", "avx2"])
def test_f8_e4m3_kernels_decode_every_value_exactly(build: str, flush_denormal: bool) -> None:
    """Every kernel path of every build decodes each E4M3 value exactly, subnormals (m * 2^-9) too, also with the
    denormals-are-zero flag on: x = I makes y the weights themselves (one product, rounded once, as dequantize
    rounds it), by the direct kernel, the panel one and the row lookup."""
    ops = kernels.load(portable=True) if build == "portable" else kernels.load(isa=None if build == "native" else build)
    assert ops is not None, f"the {build} quantized kernels did not build"
    values, scale = _every_e4m3()
    packed, expected = pack_fp8(values, scale), values.float() * scale[:, None]
    eye, ids = torch.eye(256), torch.tensor([2, 0, 1])
    assert torch.set_flush_denormal(flush_denormal) or not flush_denormal, "this CPU cannot flush denormals"
    try:
        for max_direct_rows in (0, 1 << 20):
            y = kernels.block_linear(eye, packed, F8_E4M3, None, ops, max_direct_rows=max_direct_rows)
            assert torch.equal(y.T, expected), max_direct_rows
        assert torch.equal(ops.block_dequantize(packed, ids, F8_E4M3.ggml_type, 256), expected[ids])
    finally:
        torch.set_flush_denormal(False)


def test_f8_e4m3_has_no_int8_dot_kernel() -> None:
    """block_gemm_int8 multiplies integers: it refuses F8_E4M3 by name (the GEMM plan never offers it)."""
    ops = kernels.load()
    assert ops is not None
    values, scale = _every_e4m3()
    with pytest.raises(RuntimeError, match="F8_E4M3 blocks have no int8-dot kernel"):
        ops.block_gemm_int8(torch.randn(2, 256).bfloat16(), pack_fp8(values, scale), F8_E4M3.ggml_type, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS.values(), ids=lambda f: f.name)
def test_cuda_path_keeps_blocks_and_matches_cpu(fmt: BlockFormat) -> None:
    """On CUDA the blocks stay packed in device memory and each call dequantizes them (a plain torch path)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    packed, x = quantize(_weight(129, 160, seed=4), fmt), torch.randn(7, 160)
    y = kernels.block_linear(x.cuda(), packed.cuda(), fmt, None)
    assert y.is_cuda
    torch.testing.assert_close(y.cpu().double(), _reference(x, packed, fmt, None), rtol=1e-4, atol=1e-4)
    rows = kernels.block_rows(packed.cuda(), torch.tensor([0, 5], device="cuda"), fmt, torch.bfloat16)
    assert rows.dtype == torch.bfloat16 and rows.is_cuda
