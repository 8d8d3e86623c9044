"""The Triton kernel on ggml blocks (runner/layers/quantization/triton_block_gemm.py) against dequantize-then-matmul
in float64. On CUDA the kernel is compiled; on CPU it runs in Triton's interpreter (TRITON_INTERPRET=1), and its
compiled form is checked to build for an H100 (sm_90) without one. The `gpu` tests run quantized tiny models on CUDA
against the same models on CPU."""
from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.models.tiny_model import make_tiny_model
from raylm.runner.layers.quantization import kernels
from raylm.runner.layers.quantization.ggml_blocks import F8_E4M3, FORMATS, BlockFormat, dequantize, quantize
from scripts.gpu_measure import QUANT_BATCHES, block_gemm_rows
from tests.gguf_files import write_gguf
from tests.reference import TOP_K, assert_same_output

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
REPO = Path(__file__).resolve().parents[1]

# On CPU the kernel's module is imported (again, if it was already) under TRITON_INTERPRET=1: its kernel uses only
# Triton's builtins, so it runs interpreted whenever triton itself was imported (torch imports it early).
with pytest.MonkeyPatch.context() as _patch:
    if not ON_CUDA:
        _patch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    from raylm.runner.layers.quantization import triton_block_gemm

    if not ON_CUDA and not isinstance(triton_block_gemm.block_gemm, InterpretedFunction):  # imported earlier
        importlib.reload(triton_block_gemm)


def _reference(x: torch.Tensor, packed: torch.Tensor, fmt: BlockFormat, bias: torch.Tensor | None) -> torch.Tensor:
    """float64 x W^T (+ bias), W decoded and rounded to x's dtype as the kernel decodes it."""
    w = dequantize(packed.cpu(), fmt).to(x.dtype).double()
    y = x.cpu().double() @ w.T
    return y if bias is None else y + bias.cpu().double()


KERNEL_FORMATS = [*FORMATS.values(), F8_E4M3]  # ggml's and raylm's FP8 blocks
# Half a unit in the last place of y's dtype (the one rounding of the float32 sum), relative; float32: the sum's order.
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2**-8, torch.float16: 2**-11}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("fmt", KERNEL_FORMATS, ids=lambda f: f.name)
def test_matches_dequantize_then_matmul(fmt: BlockFormat, m: int, with_bias: bool, dtype: torch.dtype) -> None:
    """K of 5 blocks (a partial last K step at every tile size), N = 40 (not a multiple of the 32 / 64 tiles), a
    decode tile (M 1, 3) and a prefill one (M 17, two row tiles)."""
    generator = torch.Generator().manual_seed(m)
    n, k = 40, 160
    packed = quantize(torch.randn(n, k, generator=generator), fmt)
    x = torch.randn(m, k, generator=generator).to(dtype)
    bias = torch.randn(n, generator=generator).to(dtype) if with_bias else None
    y = triton_block_gemm.block_linear(x.to(DEVICE), packed.to(DEVICE), fmt,
                                       None if bias is None else bias.to(DEVICE))
    assert y.dtype == dtype and y.shape == (m, n)
    torch.testing.assert_close(y.cpu().double(), _reference(x, packed, fmt, bias), rtol=RTOL[dtype], atol=1e-4)


def test_leading_dims_strided_x_and_no_rows() -> None:
    """x [2, 3, K] a column slice of a wider tensor (rows not contiguous): y [2, 3, N]; no rows: an empty y."""
    fmt = FORMATS["Q4_1"]
    generator = torch.Generator().manual_seed(5)
    packed = quantize(torch.randn(33, 64, generator=generator), fmt)
    wide = torch.randn(2, 3, 96, generator=generator)
    x = wide[..., 16:80]
    y = triton_block_gemm.block_linear(x.to(DEVICE), packed.to(DEVICE), fmt, None)
    assert y.shape == (2, 3, 33)
    torch.testing.assert_close(y.cpu().double(), _reference(x.reshape(6, 64), packed, fmt, None).reshape(2, 3, 33),
                               rtol=1e-5, atol=1e-5)
    empty = triton_block_gemm.block_linear(x[:, :0].to(DEVICE), packed.to(DEVICE), fmt, None)
    assert empty.shape == (2, 0, 33)


def test_gpu_check_section_measures_each_format_and_batch() -> None:
    """scripts/gpu_check.py's section 7 (its rows) on a tiny layer, here on the CPU: its timings pass or fail on a GPU
    only, its error column is the kernel's against dequantize-then-matmul in bfloat16."""
    rows: list[dict] = []
    block_gemm_rows(rows, "7 quant kernel", DEVICE, {"tiny 40x64": (40, 64)})
    assert [r["metric"] for r in rows] == [f"{fmt} tiny 40x64 batch {m}: triton / dequant+matmul"
                                           for fmt in FORMATS for m in QUANT_BATCHES]
    for row in rows:
        error = float(row["value"].split("error ")[1].split(",")[0])
        assert error <= 1e-2 and ("GB/s" in row["value"]) == (" batch 1:" in row["metric"]), row


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from raylm.runner.layers.quantization import triton_block_gemm as t
from raylm.runner.layers.quantization.ggml_blocks import F8_E4M3, FORMATS
for fmt in [*FORMATS.values(), F8_E4M3]:
    scale_dtype, scales = t.HEADERS[fmt.ggml_type]
    sig = {"x_ptr": "*bf16", "w_ptr": "*i8", "w_scale_ptr": "*fp16" if scale_dtype.itemsize == 2 else "*fp32",
           "bias_ptr": "*bf16", "y_ptr": "*bf16",
           **dict.fromkeys(["M", "N", "K", "stride_xm", "stride_ym", "row_bytes"], "i32")}
    consts = dict(FORMAT=fmt.ggml_type, TYPE_BYTES=fmt.type_bytes, HEADER_BYTES=scale_dtype.itemsize * scales,
                  SCALE_BYTES=scale_dtype.itemsize, HAS_BIAS=True, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128,
                  DOT_PRECISION=None, INTERPRETED=False)
    kernel = triton.compile(ASTSource(t.block_gemm, {**sig, **dict.fromkeys(consts, "constexpr")}, consts),
                            target=GPUTarget("cuda", 90, 32))
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in kernel.asm["ptx"], fmt.name
    print(fmt.name, "sm_90 cubin", len(kernel.asm["cubin"]), "bytes")
"""


@pytest.mark.skipif(ON_CUDA, reason="on CUDA the tests above run the compiled kernel")
def test_compiles_for_sm90_with_tensor_core_dots() -> None:
    """The interpreter runs the kernel's Python, not its compiled form: build that (Triton's own ptxas, no GPU
    needed) for an H100, for each format (F8_E4M3 too) with bfloat16 x, and check its dots are bfloat16 tensor-core
    MMAs."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("sm_90 cubin") == len(FORMATS) + 1, done.stdout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt", KERNEL_FORMATS, ids=lambda f: f.name)
@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
def test_cuda_layers_take_the_kernel(fmt: BlockFormat, dtype: torch.dtype) -> None:
    """kernels.block_linear on CUDA tensors is the Triton kernel (the same bits), not the dequantize-per-call path."""
    generator = torch.Generator().manual_seed(4)
    packed = quantize(torch.randn(129, 4096, generator=generator), fmt).cuda()
    x = torch.randn(7, 4096, generator=generator).to(dtype).cuda()
    y = kernels.block_linear(x, packed, fmt, None)
    assert torch.equal(y, triton_block_gemm.block_linear(x, packed, fmt, None))
    torch.testing.assert_close(y.cpu().double(), _reference(x, packed, fmt, None), rtol=RTOL[dtype], atol=1e-3)


def _greedy(path: Path, device: str, **settings: object) -> list[tuple[list[int], list[dict[int, float]]]]:
    llm = LLM(model=str(path), device=device, dtype="float32", max_model_len=128, block_size=16,
              enable_prefix_caching=False, **settings)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=TOP_K)
        prompts = [[5, 17, 33, 400, 12], list(range(10, 70)), [300] * 3, [7]]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kind", ["int4", "gguf-Q4_0", pytest.param("gptq", marks=pytest.mark.skipif(
    importlib.util.find_spec("gptqmodel") is None, reason="GPTQModel (the GPTQ writer) is not installed"))])
@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
def test_quantized_model_on_cuda_matches_cpu(kind: str, tmp_path: Path) -> None:
    """float32 on both devices: the same greedy tokens and top-5 logprobs. int4: Q4_1 linears and a Q8_0 LM head;
    gguf-Q4_0: Q4_0 linears, a Q8_0 embedding and head; gptq: a GPTQModel folder (Q4_1 after repacking)."""
    path = make_tiny_model(tmp_path / "float", num_layers=2, hidden_size=64, intermediate_size=128, vocab_size=512)
    settings: dict[str, object] = {}
    if kind == "int4":
        settings["quantization"] = "int4"
    elif kind == "gguf-Q4_0":
        path = write_gguf(path, tmp_path / "tiny-Q4_0.gguf", gguf.GGMLQuantizationType.Q4_0)
    else:
        from tests.quant_format_checkpoints import write_gptq
        path = write_gptq(path, tmp_path / "gptq", desc_act=False, sym=False)
    assert_same_output(_greedy(path, "cuda", **settings), _greedy(path, "cpu", **settings))
