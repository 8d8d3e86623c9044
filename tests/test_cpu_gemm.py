"""CPU linear kernels chosen per weight shape and row count by timing (runner/layers/cpu_gemm.py, gemm_plans.py)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig

from raylm.runner import cpu_kernels
from raylm.runner.layers import cpu_gemm, gemm_plans
from raylm.runner.layers.cpu_gemm import FLOAT_KERNELS, ROW_BUCKETS, CpuGemmMixin, GemmPlan
from raylm.runner.layers.gemm_plans import plan_linears
from raylm.runner.layers.linear import LinearBase
from raylm.runner.models.loader import load_model
from raylm.runner.parallel_state import destroy_model_parallel, init_model_parallel

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


@pytest.fixture(autouse=True)
def _single_process_groups() -> Iterator[None]:
    init_model_parallel(1, 1)
    yield
    destroy_model_parallel()


@pytest.fixture
def gemm_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RAYLM_CACHE_DIR", str(tmp_path))
    return tmp_path / "gemm_plans"


def test_rows_map_to_the_first_bucket_at_or_above() -> None:
    plan = GemmPlan(tuple("onednn" if i % 2 else "sgemm" for i in range(len(ROW_BUCKETS))))  # 1: sgemm, 2: onednn
    expected = {1: 0, 2: 1, 3: 2, 4: 2, 5: 3, 8: 3, 9: 4, 64: 6, 65: 7, 512: 9, 513: 10, 1024: 10, 100_000: 10}
    for rows, bucket in expected.items():
        assert plan.kernel_for(rows) == ("onednn" if bucket % 2 else "sgemm"), rows
    assert GemmPlan(("sgemm",) * 3 + ("onednn",) * 2).describe() == "sgemm up to 4 rows, then onednn"
    assert (GemmPlan(("skinny", "sgemm", "onednn")).describe()
            == "skinny up to 1 row, then sgemm up to 2 rows, then onednn")
    assert GemmPlan(("onednn",) * 11).describe() == "onednn"


def test_every_linear_gets_its_shape_plan_from_one_timing(llama_path: Path, gemm_cache: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    timed: list[tuple[int, ...]] = []
    real_time_kernels = gemm_plans.time_kernels

    def counting(layers: list[CpuGemmMixin]) -> tuple[GemmPlan, dict[str, list[float]]]:
        assert len({tuple(layer.weight.shape) for layer in layers}) == 1, "one shape's layers per timing"
        timed.append(tuple(layers[0].weight.shape))
        return real_time_kernels(layers)

    monkeypatch.setattr(gemm_plans, "time_kernels", counting)
    model = load_model(llama_path, AutoConfig.from_pretrained(llama_path))
    layers = [m for m in model.modules() if isinstance(m, CpuGemmMixin)]
    shapes = {tuple(m.weight.shape) for m in layers}
    assert sorted(timed) == sorted(shapes), "each shape is timed once, whatever its number of layers"
    assert all(m.gemm_plan is not None for m in layers)
    assert len(list(gemm_cache.glob("*/plans.json"))) == 1

    # A second load (another worker, a later start-up) reads the plans instead of timing again.
    timed.clear()
    again = load_model(llama_path, AutoConfig.from_pretrained(llama_path))
    assert timed == []
    plans = {tuple(m.weight.shape): m.gemm_plan for m in layers}
    assert all(plans[tuple(m.weight.shape)] == m.gemm_plan for m in again.modules() if isinstance(m, CpuGemmMixin))


@pytest.mark.parametrize("kernel", FLOAT_KERNELS)
def test_every_kernel_computes_the_linear(kernel: str, gemm_cache: Path) -> None:
    """Each kernel alone gives F.linear's result, at row counts inside, at and past the skinny kernel's register
    block (12 rows a pass with AVX-512, 4 with AVX2; 13 and 25 rows split into equal passes) and past a bucket; a plan
    keeps only the packed copies it uses."""
    if kernel == "skinny" and cpu_kernels.load() is None:
        pytest.skip("raylm's CPU kernels could not be built here")
    torch.manual_seed(0)
    layer = LinearBase(96, 80, bias=True)  # 80 outputs: two and a half 32-wide panels
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    layer.process_weights_after_loading()
    assert layer.packed_weight is not None and layer.skinny_weight is None
    layer.gemm_plan = GemmPlan((kernel,) * len(ROW_BUCKETS))
    layer.process_weights_after_loading()  # what plan_linears and sleep mode's wake-up do
    assert (layer.packed_weight is not None) == (kernel == "onednn"), "a plan without oneDNN keeps no packed copy"
    assert (layer.skinny_weight is not None) == (kernel == "skinny")
    for rows in (1, 3, 5, 8, 12, 13, 17, 25, 300):
        x = torch.randn(rows, 96)
        for bias in (layer.bias, None):
            torch.testing.assert_close(layer.matmul(x, bias), F.linear(x, layer.weight, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kernel", FLOAT_KERNELS)
def test_every_kernel_computes_a_bf16_linear(kernel: str, gemm_cache: Path) -> None:
    """A bfloat16 layer through each kernel (oneDNN's bfloat16 matmul where it packs, the skinny kernel's bfloat16
    panels): F.linear in float32 on the same values, within the bfloat16 result's rounding."""
    if kernel == "skinny" and cpu_kernels.load() is None:
        pytest.skip("raylm's CPU kernels could not be built here")
    if kernel == "onednn" and not cpu_gemm.onednn_packs(torch.bfloat16):
        pytest.skip("oneDNN does not pack bfloat16 on this CPU")
    torch.manual_seed(0)
    layer = LinearBase(97, 80, bias=True).to(torch.bfloat16)  # an odd input count: the skinny panels' padded pair
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    layer.gemm_plan = GemmPlan((kernel,) * len(ROW_BUCKETS))
    layer.process_weights_after_loading()
    assert (layer.skinny_weight is not None) == (kernel == "skinny")
    for rows in (1, 5, 13, 64, 300):
        x = torch.randn(rows, 97, dtype=torch.bfloat16)
        got = layer.matmul(x, layer.bias)
        assert got.dtype == torch.bfloat16
        expected = F.linear(x.float(), layer.weight.float(), layer.bias.float())
        torch.testing.assert_close(got.float(), expected, rtol=2**-8, atol=2e-3)


def test_the_avx2_build_of_the_skinny_kernel_computes_the_linear() -> None:
    """The AVX2 path (4 rows a pass, 8-float registers), built here whatever this CPU has beyond AVX2: F.linear's
    result inside and past a pass, past a 32-wide panel, and at the largest rows a plan times it for."""
    ops = cpu_kernels.load_avx2()
    if ops is None:
        pytest.skip("no AVX2 + FMA here, or the kernels could not be built")
    assert ops is not cpu_kernels.load()
    torch.manual_seed(0)
    weight, bias = torch.randn(80, 96), torch.randn(80)
    packed = ops.pack_skinny(weight)
    for rows in (1, 3, 4, 5, 9, 17, 64, 129):
        x = torch.randn(rows, 96)
        for b in (bias, None):
            torch.testing.assert_close(ops.skinny_linear(x, packed, 80, b), F.linear(x, weight, b), rtol=1e-5,
                                       atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_skinny_is_timed_only_with_the_cpu_kernels(gemm_cache: Path, dtype: torch.dtype) -> None:
    """custom_ops="none" (kernels off) plans sgemm and oneDNN only; with the kernels, skinny is timed up to 128 rows,
    on bfloat16 weights as on float32 ones."""
    if not cpu_gemm.onednn_packs(dtype):
        pytest.skip(f"oneDNN does not pack {dtype} on this CPU: such layers are not planned")
    layers = [LinearBase(64, 48, bias=False).to(dtype) for _ in range(2)]
    for layer in layers:
        layer.process_weights_after_loading()
    cpu_kernels.set_enabled(False)
    try:
        plan, figures = gemm_plans.time_kernels(layers)
    finally:
        cpu_kernels.set_enabled(True)
    assert "skinny" not in plan.kernels and "skinny" not in figures
    if cpu_kernels.load() is not None:
        plan, figures = gemm_plans.time_kernels(layers)
        assert len(figures["skinny"]) == ROW_BUCKETS.index(128) + 1


def test_a_shape_whose_plan_never_uses_onednn_drops_its_packed_copy(gemm_cache: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemm_plans, "time_kernels", lambda layers: (GemmPlan(("sgemm",) * len(ROW_BUCKETS)), {}))
    model = torch.nn.Sequential(LinearBase(32, 48, bias=False), LinearBase(32, 48, bias=False))
    for layer in model:
        layer.process_weights_after_loading()
    plan_linears(model)
    assert all(layer.packed_weight is None and layer.gemm_plan is not None for layer in model)


@pytest.fixture
def no_bf16_packing(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN's bfloat16 packing forced unavailable, as on an AVX2-only CPU, whatever this CPU has."""
    real = cpu_gemm.onednn_packs
    monkeypatch.setattr(cpu_gemm, "onednn_packs", lambda dtype: dtype != torch.bfloat16 and real(dtype))


def test_bf16_packing_follows_what_onednn_reports() -> None:
    assert cpu_gemm.onednn_packs(torch.bfloat16) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert cpu_gemm.onednn_packs(torch.float32)
    assert not cpu_gemm.onednn_packs(torch.float16)


@pytest.mark.parametrize("bias", [True, False])
def test_bf16_without_packing_runs_sgemm_on_a_float32_copy(no_bf16_packing: None, bias: bool) -> None:
    torch.manual_seed(0)
    layer = LinearBase(96, 80, bias=bias).to(torch.bfloat16)
    layer.weight.data.normal_()
    if bias:
        layer.bias.data.normal_()
    layer.process_weights_after_loading()
    assert layer.packed_weight is None and layer.kernel_name() == "sgemm_fp32"
    for rows in (1, 7, 300):
        x = torch.randn(rows, 96, dtype=torch.bfloat16)
        expected = F.linear(x.float(), layer.weight.float(), layer.bias.float() if bias else None).bfloat16()
        got = layer.matmul(x, layer.bias)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_bf16_model_loads_and_generates_without_packing(no_bf16_packing: None, llama_path: Path, gemm_cache: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """What failed on AVX2-only CPUs: a bfloat16 model's load packed its first linear. Now it generates, and its greedy
    tokens follow transformers' float32 ones under the oracle's top-5 rule."""
    from raylm.cluster import LLM, SamplingParams
    from tests.reference import check_logprobs_close, hf_greedy

    prompts = [[5, 17, 42, 99, 3], [7, 8, 9], list(range(20, 60))]
    with caplog.at_level("INFO", logger=gemm_plans.logger.name):
        llm = LLM(model=str(llama_path), dtype="bfloat16", disable_log_stats=True)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5),
                               use_tqdm=False)
    finally:
        llm.shutdown()
    assert "sgemm_fp32" in caplog.text and "bfloat16 weights upcast" in caplog.text
    ours = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]
    check_logprobs_close(hf_greedy(llama_path, prompts, 8), ours, "bf16 without packing")
