"""Quantized checkpoints as shipped, at `dtype: auto` on a CPU with bfloat16 dot products: they compute in bfloat16
(as GGUF, int8 and int4 do), held to the 16-bit parity rule against transformers loading the same folder in
bfloat16 (greedy tokens equal except at a near-tie), and where the AMX kernel runs no linear keeps a float copy of
its weight: the blocks alone are the plan's candidates."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.models.tiny_model import make_tiny_model
from raylm.configs import model_info
from raylm.configs.model_info import read_model_info
from raylm.runner.layers.cpu_gemm import BLOCK_KERNELS
from raylm.runner.layers.quantization import kernels
from raylm.runner.layers.quantization.ggml_blocks import F8_E4M3
from raylm.runner.models.loader import load_model
from tests.quant_format_checkpoints import greedy, write_compressed_tensors, write_gptq
from tests.reference import TOP_K, check_logprobs_close
from tests.runner_steps import model_parallel_of_one  # noqa: F401 - a fixture

pytestmark = pytest.mark.skipif(not model_info.cpu_multiplies_bf16(), reason="no bfloat16 dot products on this CPU")

PROMPTS = [[5, 17, 33, 400, 12], list(range(10, 70)), [7]]
MAX_TOKENS = 8
QUANTIZATION = {"w4a16-group-asym": "compressed-tensors", "w8a8-int": "compressed-tensors",
                "fp8-channel": "compressed-tensors", "gptq-desc_act-asym": "gptq"}


@pytest.fixture(scope="module")
def formats(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bf16formats")
    source = make_tiny_model(root / "float", num_layers=2, hidden_size=64, intermediate_size=128, vocab_size=512)
    paths = {name: write_compressed_tensors(source, name, root / name)
             for name in QUANTIZATION if name != "gptq-desc_act-asym"}
    paths["gptq-desc_act-asym"] = write_gptq(source, root / "gptq", desc_act=True, sym=False)
    return paths


def test_auto_picks_bfloat16_for_checkpoint_formats(formats: dict[str, Path]) -> None:
    llm = LLM(model=str(formats["w4a16-group-asym"]), max_model_len=128, block_size=16)
    try:
        assert llm.llm_engine.config.resolved.dtype == "bfloat16"
    finally:
        llm.shutdown()


@pytest.mark.parametrize("name", list(QUANTIZATION))
def test_format_in_bfloat16_matches_transformers(formats: dict[str, Path], name: str) -> None:
    llm = LLM(model=str(formats[name]), dtype="auto", max_model_len=128, block_size=16)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        ours = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]
    finally:
        llm.shutdown()
    settings: dict = {"device_map": "cpu"}
    if QUANTIZATION[name] == "compressed-tensors":
        settings["quantization_config"] = CompressedTensorsConfig(run_compressed="asym" not in name)
    model = AutoModelForCausalLM.from_pretrained(formats[name], dtype=torch.bfloat16, **settings).eval()
    check_logprobs_close(greedy(model, PROMPTS, MAX_TOKENS), ours, f"{name} bfloat16")


@pytest.mark.usefixtures("model_parallel_of_one")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize("name", ["w4a16-group-asym", "gptq-desc_act-asym"])
def test_no_float_copy_beside_the_blocks(formats: dict[str, Path], name: str, dtype: torch.dtype) -> None:
    """Planned in bfloat16 or float32, each linear of a checkpoint format keeps its blocks alone on every CPU (a
    float copy beside them would hold more than the float checkpoint), its plan choosing among the block kernels
    only, AMX's or AVX512-BF16's among them for bfloat16 where the CPU has them."""
    info = read_model_info(str(formats[name]))
    model = load_model(formats[name], info.hf_config, dtype=dtype, quantization=QUANTIZATION[name])
    amx = kernels.amx_kernels_for(torch.device("cpu"), dtype) is not None
    bf16_dot = kernels.bf16_dot_kernels_for(torch.device("cpu"), dtype) is not None
    for layer in model.model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert linear.gemm_plan is not None and linear.kernel_name() == "planned", "quantized layers are planned"
            assert (linear.bf16_matmul is not None) == bf16_dot and (linear.amx_matmul is not None) == amx
            assert linear.dequantized is None and set(linear.gemm_plan.kernels) <= BLOCK_KERNELS, linear.gemm_plan


@pytest.mark.usefixtures("model_parallel_of_one")
def test_fp8_blocks_never_plan_the_int8_kernel(formats: dict[str, Path]) -> None:
    """FP8 linears keep their F8_E4M3 blocks in bfloat16 too; E4M3 values are not integers, so the int8-dot kernel
    (offered to an int4 layer here) is never a candidate of their plan."""
    int8 = kernels.int8_kernels_for(torch.device("cpu"), torch.bfloat16) is not None
    for name in ("fp8-channel", "w4a16-group-asym"):
        info = read_model_info(str(formats[name]))
        model = load_model(formats[name], info.hf_config, dtype=torch.bfloat16, quantization=QUANTIZATION[name])
        for layer in model.model.layers:
            for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                           layer.mlp.down_proj):
                fp8 = linear.weight.quant_format is F8_E4M3
                assert fp8 == (name == "fp8-channel") and linear.gemm_plan is not None
                assert (linear.int8_matmul is not None) == (int8 and not fp8)
                assert not (fp8 and "packed_int8" in linear.gemm_plan.kernels), linear.gemm_plan
