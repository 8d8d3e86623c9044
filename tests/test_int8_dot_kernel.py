"""The block kernels' few-row path (csrc/quant/int8_dot.h): x quantized to int8 per block of 32, integer dot products
against each block's integers. In every instruction-set build (this CPU's, AVX-VNNI without AVX-512, AVX2 alone, the
portable loops) it equals the product of the same int8 x and the dequantized weights up to float32 summation, and
stays within the int8 rounding bound of the float32 x product."""
from __future__ import annotations

import pytest
import torch

from raylm.runner.cpu_kernels import cpu_flags
from raylm.runner.layers.quantization import kernels
from raylm.runner.layers.quantization.ggml_blocks import FORMATS, BlockFormat, dequantize, quantize

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


def _quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x as the kernel quantizes it (ggml's Q8_0 arithmetic in float32, rounding half to even): d * q per block."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.round(blocks * torch.where(d > 0, 1 / d, 0))
    return q.reshape(x.shape), d.squeeze(-1)


def int8_x(x: torch.Tensor) -> torch.Tensor:
    """x [m, k] as the few-row path multiplies it, in float64: each block's int8 times its scale."""
    q, d = _quantize_x(x)
    return (q.double().reshape(x.shape[0], -1, 32) * d.double().unsqueeze(-1)).reshape(x.shape)


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
            y = kernels.block_linear(x, packed, fmt, None, ops).double()
            q, d = _quantize_x(x)
            assert q.abs().max() <= 127
            exact = int8_x(x) @ weight.T
            case = f"{build} {fmt.name} {m}x{n}x{k}"
            torch.testing.assert_close(y, exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item(),
                                       msg=lambda text, case=case: f"{case}: {text}")
            # Against float32 x: each x within half its block's step, so |error| <= sum |w| * d / 2 per output.
            bound = weight.abs() @ (d.double() / 2).repeat_interleave(32, dim=1).T
            assert ((y - x.double() @ weight.T).abs() <= bound.T * 1.001 + 1e-6).all(), case


def test_rows_past_the_int8_path_take_the_tiles() -> None:
    """Above max_direct_rows the tiled path multiplies float32 x as it is: equal to the float64 product to 1e-5."""
    fmt = FORMATS["Q4_1"]
    packed = quantize(_weight(64, 96, seed=3), fmt)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(3))
    reference = x.double() @ dequantize(packed, fmt).double().T
    tiled = kernels.block_linear(x, packed, fmt, None, _ops("native"), max_direct_rows=4).double()
    direct = kernels.block_linear(x, packed, fmt, None, _ops("native"), max_direct_rows=5).double()
    torch.testing.assert_close(tiled, reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())
    assert not torch.allclose(direct, reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())
