"""The block kernel on int8 x (`packed_int8`, csrc/quant/int8_dot.h): x quantized to int8 per block of 32, integer dot
products against each block's integers. In every instruction-set build (this CPU's, AVX-VNNI without AVX-512, AVX2
alone, the portable loops) it equals the product of the same int8 x and the dequantized weights up to float32
summation, and stays within the int8 rounding bound of the float32 x product; a bfloat16 quantized layer offers it to
its GEMM plan, a float32 one does not."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from raylm.runner.cpu_kernels import cpu_flags
from raylm.runner.layers.cpu_gemm import ROW_BUCKETS, GemmPlan
from raylm.runner.layers.linear import ColumnParallelLinear
from raylm.runner.layers.quantization import get_quantization_config, kernels
from raylm.runner.layers.quantization.base_config import set_quant_config
from raylm.runner.layers.quantization.ggml_blocks import FORMATS, BlockFormat, dequantize, quantize
from tests.runner_steps import model_parallel_of_one  # noqa: F401 - a fixture

# build -> (the CPU flags it needs, the path it must take). The native build takes this CPU's best path.
BUILDS = {"avx_vnni": ({"avx2", "fma", "avx_vnni"}, "avx_vnni"), "avx2": ({"avx2", "fma"}, "avx2"),
          "portable": (set(), "portable")}
# (N, K): an odd count of blocks (the AVX-512 path's last block alone), one block, several pairs.
SHAPES = [(37, 96), (5, 32), (129, 160)]
ROWS = (1, 2, 3, 8)


def _ops(build: str):  # noqa: ANN202 - the built extension module
    if build == "native":
        ops = kernels.load()
    else:
        needs, _ = BUILDS[build]
        if not needs <= set(cpu_flags().split()):
            pytest.skip(f"this CPU cannot run the {build} build (needs {sorted(needs)})")
        ops = kernels.load(portable=True) if build == "portable" else kernels.load(isa=build)
    assert ops is not None, f"the {build} quantized kernels did not build"
    return ops


def _native_path() -> str:
    flags = set(cpu_flags().split())
    if {"avx512_vnni", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        return "avx512_vnni"
    return "avx_vnni" if "avx_vnni" in flags else "avx2" if {"avx2", "fma"} <= flags else "portable"


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator) * torch.logspace(-2, 1, n).unsqueeze(1)
    weight[0, :32] = 0  # a block of zeros: scale 0
    return weight


@pytest.mark.parametrize("build", ["native", *BUILDS])
def test_build_takes_its_path(build: str) -> None:
    assert _ops(build).int8_path() == (_native_path() if build == "native" else BUILDS[build][1])


@pytest.mark.parametrize("build", ["native", *BUILDS])
@pytest.mark.parametrize("fmt", FORMATS.values(), ids=lambda f: f.name)
def test_int8_path_equals_its_reference(build: str, fmt: BlockFormat) -> None:
    ops = _ops(build)
    for n, k in SHAPES:
        packed = quantize(_weight(n, k, seed=n + k), fmt)
        weight = dequantize(packed, fmt).double()
        for m in ROWS:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m * k)) * torch.logspace(-1, 1, k)
            x[0, 32:64] = 0  # a block of x all zero: its scale 0
            y = kernels.int8_linear(x, packed, fmt, None, ops).double()
            exact = kernels.int8_activations(x) @ weight.T
            case = f"{build} {fmt.name} {m}x{n}x{k}"
            torch.testing.assert_close(y, exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item(),
                                       msg=lambda text, case=case: f"{case}: {text}")
            # Against float32 x: each x within half its block's step d, so |error| <= sum |w| * d / 2 per output.
            d = x.double().reshape(m, -1, 32).abs().amax(-1) / 127
            bound = weight.abs() @ (d / 2).repeat_interleave(32, dim=1).T
            assert ((y - x.double() @ weight.T).abs() <= bound.T * 1.001 + 1e-6).all(), case


@pytest.mark.usefixtures("model_parallel_of_one")  # the layer is built outside an engine
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_plan_offers_it_for_bfloat16_activations(dtype: torch.dtype) -> None:
    """A bfloat16 layer planned `packed_int8` runs the integer kernel (bias added, y bfloat16); a float32 layer has no
    such candidate (its activations keep exact products) and the name falls back to the float32 block kernel."""
    with set_quant_config(get_quantization_config("int4", AutoConfig.for_model("llama"))):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            layer = ColumnParallelLinear(96, 40, bias=True)
        finally:
            torch.set_default_dtype(previous)
    generator = torch.Generator().manual_seed(4)
    layer.weight.weight_loader(layer.weight, torch.randn(40, 96, generator=generator))
    layer.bias.weight_loader(layer.bias, torch.randn(40, generator=generator).to(dtype))
    layer.process_weights_after_loading()
    layer.gemm_plan = GemmPlan(("packed_int8",) * len(ROW_BUCKETS))
    layer.process_weights_after_loading()
    assert (layer.int8_matmul is not None) == (dtype == torch.bfloat16)
    x = torch.randn(3, 96, generator=generator).to(dtype)
    fmt = FORMATS["Q4_1"]
    kernel = kernels.int8_linear if dtype == torch.bfloat16 else kernels.block_linear
    expected = kernel(x, layer.weight, fmt, layer.bias, _ops("native"))
    assert torch.equal(layer(x), expected)
