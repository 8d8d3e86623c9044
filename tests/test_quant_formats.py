"""Quantized checkpoints as shipped (compressed-tensors, GPTQ, AWQ), each written by its format's own tool on CPU and
compared with transformers loading the same folder: logprobs within the format's tolerance, greedy tokens equal
except at a near-tie (check_logprobs_close).

transformers runs compressed-tensors through its integration (run_compressed, which quantizes W8A8 / FP8 activations
per token; dequantized for asymmetric pack-quantized, whose packed zero points its compressed path fails to load
here), and GPTQ and AWQ through optimum + GPTQModel's torch kernels on CPU."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.models.tiny_model import make_tiny_model
from raylm.configs.model_info import read_model_info
from raylm.runner.layers import gemm_plans
from raylm.runner.layers.cpu_gemm import ROW_BUCKETS, GemmPlan
from raylm.runner.layers.quantization.checkpoint_formats import CheckpointQuantMethod
from raylm.runner.models.loader import load_model
from tests.quant_format_checkpoints import (
    CT_SCHEMES,
    greedy,
    write_awq,
    write_compressed_tensors,
    write_gptq,
)
from tests.reference import TOP_K, check_logprobs_close
from tests.runner_steps import model_parallel_of_one  # noqa: F401 - a fixture

MAX_TOKENS = 8
PROMPTS = [[5, 17, 33, 400, 12], list(range(10, 70)), [300] * 3, [7]]
ENGINE = dict(dtype="float32", max_model_len=128, block_size=16, enable_prefix_caching=False)
# Largest |logprob| difference from the reference on the tokens both rank in their top-5: float16 block scales
# (4 and 8 bits), per-token int8 rounding of activations that sit on a rounding boundary (W8A8), the reference's
# float16 products (GPTQModel's CPU kernels, under transformers, compute GPTQ and AWQ in float16).
TOLERANCE = {"w8a8-int": 1e-2, "fp8-tensor": 1e-4, "fp8-channel": 1e-4, "gptq": 5e-3, "awq": 5e-3}
BLOCK_KINDS = {"w4a16-group-asym": "Q4_1", "w4a16-group-sym": "Q4_0", "w4a16-channel-asym": "Q4_1",
               "w8a16-channel-sym": "Q8_0", "w8a8-int": "Q8_0", "fp8-tensor": "F8_E4M3", "fp8-channel": "F8_E4M3",
               "gptq-desc_act-asym": "Q4_1", "gptq-sym": "Q4_0", "awq": "Q4_1"}

Result = list[tuple[list[int], list[dict[int, float]]]]


@pytest.fixture(scope="module")
def float_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """hidden 64, intermediate 128: 2 and 4 blocks of 32 per row; at TP=2 o_proj's 32 inputs per rank split a
    group of 64 (w4a16-group-asym) across the ranks."""
    return make_tiny_model(tmp_path_factory.mktemp("qf") / "float", num_layers=2, hidden_size=64,
                           intermediate_size=128, vocab_size=512)


@pytest.fixture(scope="module")
def formats(float_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("formats")
    paths = {name: write_compressed_tensors(float_path, name, root / name) for name in CT_SCHEMES}
    paths["gptq-desc_act-asym"] = write_gptq(float_path, root / "gptq-desc_act-asym", desc_act=True, sym=False)
    paths["gptq-sym"] = write_gptq(float_path, root / "gptq-sym", desc_act=False, sym=True)
    paths["awq"] = write_awq(float_path, root / "awq")
    return paths


def run(path: Path, **settings: object) -> Result:
    llm = LLM(model=str(path), **ENGINE, **settings)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]
    finally:
        llm.shutdown()


def reference(name: str, path: Path) -> Result:
    settings: dict = {"device_map": "cpu"}
    if name not in ("awq",) and not name.startswith("gptq"):  # dequantized: its compressed path fails to load them
        settings = {"quantization_config": CompressedTensorsConfig(run_compressed="asym" not in name)}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **settings).eval()
    return greedy(model, PROMPTS, MAX_TOKENS)


def max_logprob_difference(reference: Result, ours: Result) -> float:
    """Over every position up to the first divergence, the tokens both top-5s hold."""
    worst = 0.0
    for (ref_tokens, ref_tops), (our_tokens, our_tops) in zip(reference, ours):
        for ref_token, our_token, ref_top, our_top in zip(ref_tokens, our_tokens, ref_tops, our_tops):
            worst = max([worst, *(abs(ref_top[t] - our_top[t]) for t in ref_top.keys() & our_top.keys())])
            if ref_token != our_token:
                break
    return worst


@pytest.mark.parametrize("name", list(BLOCK_KINDS))
def test_format_matches_transformers(formats: dict[str, Path], name: str) -> None:
    ours = run(formats[name])
    expected = reference(name, formats[name])
    assert check_logprobs_close(expected, ours, name) <= 1
    tolerance = TOLERANCE.get(name, TOLERANCE.get(name.split("-")[0], 1e-3))
    assert max_logprob_difference(expected, ours) < tolerance


@pytest.mark.parametrize("name", ["gptq-desc_act-asym", "w8a8-int"])
def test_input_changing_formats_under_the_skinny_plan(formats: dict[str, Path], name: str,
                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every linear planned to the skinny kernel (what a timed plan may pick), which would let the CPU layer stack
    run these layers: it must leave them to their quant method, which permutes (act order) or quantizes (W8A8) x."""
    monkeypatch.setenv("RAYLM_CACHE_DIR", str(tmp_path))
    plan = GemmPlan(tuple("skinny" for _ in ROW_BUCKETS))
    monkeypatch.setattr(gemm_plans, "time_kernels", lambda layers: (plan, {}))
    ours = run(formats[name])
    assert check_logprobs_close(reference(name, formats[name]), ours, name) <= 1


@pytest.mark.parametrize("name", ["fp8-tensor", "fp8-channel"])
def test_fp8_through_its_block_kernel(formats: dict[str, Path], name: str, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Every linear planned to `packed`, the block kernel on the F8_E4M3 blocks (no float copy): on the tiny shapes
    a timed plan may give some rows to a float kernel on a dequantized copy instead."""
    monkeypatch.setenv("RAYLM_CACHE_DIR", str(tmp_path))
    plan = GemmPlan(tuple("packed" for _ in ROW_BUCKETS))
    monkeypatch.setattr(gemm_plans, "time_kernels", lambda layers: (plan, {}))
    ours, expected = run(formats[name]), reference(name, formats[name])
    assert check_logprobs_close(expected, ours, name) <= 1
    assert max_logprob_difference(expected, ours) < TOLERANCE[name]


@pytest.mark.usefixtures("model_parallel_of_one")
@pytest.mark.parametrize("name", list(BLOCK_KINDS))
def test_format_loads_into_block_kernels(formats: dict[str, Path], name: str) -> None:
    """Every linear holds the blocks the mapping names (raylm's packed kernels), not a float copy, FP8 its E4M3
    bytes (F8_E4M3: one byte a weight); GPTQ in activation order keeps its input permutation."""
    info = read_model_info(str(formats[name]))
    quantization = "gptq" if name.startswith("gptq") else "awq" if name == "awq" else "compressed-tensors"
    model = load_model(formats[name], info.hf_config, quantization=quantization)
    layer = model.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(linear.quant_method, CheckpointQuantMethod)
        fmt = linear.weight.quant_format
        assert fmt is not None and fmt.name == BLOCK_KINDS[name] and linear.weight.dtype == torch.uint8
        assert (linear.input_perm is not None) == (name == "gptq-desc_act-asym")

