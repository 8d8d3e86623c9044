"""`quantization: int8 | int4` on a float checkpoint, and TP over packed weights.

The oracle for a quantized float checkpoint is transformers on the same checkpoint with each weight the engine
quantizes replaced by its dequantized blocks (Q8_0 for int8 and every LM head, Q4_1 for int4's linears): the same
numbers, so greedy output must match in float32 (these tests pin dtype float32: `auto` computes a quantized model in
bfloat16 on a CPU with bfloat16 dot products); at the default dtype, the 16-bit parity rule against the twin in
bfloat16. TP=2 shards the packed bytes; it must give the single device's output."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gguf
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.models.tiny_model import make_tiny_model
from raylm.configs import model_info
from raylm.configs.engine_config import ModelConfig
from raylm.configs.model_info import cpu_bf16_instructions, cpu_multiplies_bf16, read_model_info, resolve_dtype
from raylm.runner import cpu_kernels
from raylm.runner.layers.cpu_gemm import BLOCK_KERNELS, KERNELS, ROW_BUCKETS, GemmPlan
from raylm.runner.layers.linear import ColumnParallelLinear, RowParallelLinear
from raylm.runner.layers.quantization import get_quantization_config, kernels
from raylm.runner.layers.quantization.base_config import set_quant_config
from raylm.runner.layers.quantization.ggml_blocks import Q4_1, Q8_0, dequantize, quantize
from tests.gguf_files import write_gguf
from tests.reference import (
    TOP_K,
    assert_equal_but_near_ties,
    assert_same_output,
    check_logprobs_close,
    greedy_with_logits,
    hf_greedy,
)
from tests.runner_steps import model_parallel_of_one  # noqa: F401 - a fixture

MAX_TOKENS = 10
PROMPTS = [[5, 17, 33, 400, 12], list(range(10, 70)), [300] * 3, [7]]
ENGINE = dict(max_model_len=128, block_size=16, enable_prefix_caching=False, dtype="float32")


@pytest.fixture(scope="module")
def tied_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """hidden 64 (two 32-weight blocks per TP rank at TP=2), tied embeddings: the LM head is the embedding."""
    return make_tiny_model(tmp_path_factory.mktemp("quant") / "tied", num_layers=2, hidden_size=64,
                           intermediate_size=128, vocab_size=512, tie_word_embeddings=True)


def _generate(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def _run(path: Path, **settings: object) -> list[tuple[list[int], list[dict[int, float]]]]:
    llm = LLM(model=str(path), **ENGINE, **settings)
    try:
        return _generate(llm)
    finally:
        llm.shutdown()


def _fake_quantized(path: Path, method: str, out: Path) -> Path:
    """The checkpoint with every weight the engine quantizes replaced by its dequantized blocks."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    linear_format = Q8_0 if method == "int8" else Q4_1
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                fmt = Q8_0 if name == "lm_head" else linear_format
                module.weight.copy_(dequantize(quantize(module.weight, fmt), fmt))
        if model.config.tie_word_embeddings:  # one tensor, quantized once, as the LM head's
            embedding = model.get_input_embeddings().weight
            embedding.copy_(dequantize(quantize(embedding, Q8_0), Q8_0))
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_float_checkpoint_matches_its_dequantized_twin(checkpoints: dict[str, Path], arch: str,
                                                                 method: str, tmp_path: Path) -> None:
    reference = hf_greedy(_fake_quantized(checkpoints[arch], method, tmp_path / "twin"), PROMPTS, MAX_TOKENS)
    assert check_logprobs_close(reference, _run(checkpoints[arch], quantization=method), f"{arch} {method}") == 0


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_default_dtype_follows_the_twin_in_bf16(checkpoints: dict[str, Path], method: str, tmp_path: Path) -> None:
    """At its defaults a quantized model computes in bfloat16 where the CPU multiplies it (elsewhere the test asks for
    bfloat16): the block kernels planned against bfloat16 kernels on a bfloat16 copy. Against transformers running
    the dequantized twin in bfloat16: equal greedy tokens, except at a near-tie."""
    twin = _fake_quantized(checkpoints["llama"], method, tmp_path / "twin")
    prompts = [*PROMPTS, list(range(200, 240)), [9, 8, 7]]
    info = read_model_info(str(checkpoints["llama"]))
    assert resolve_dtype(ModelConfig(quantization=method), info, "cpu", cpu_bf16_instructions()) == (
        "bfloat16" if cpu_multiplies_bf16() else "float32")
    llm = LLM(model=str(checkpoints["llama"]), quantization=method, max_num_seqs=8,
              **{**ENGINE, "dtype": "auto" if cpu_multiplies_bf16() else "bfloat16"})
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    reference = greedy_with_logits(AutoModelForCausalLM.from_pretrained(twin, dtype=torch.bfloat16).eval(), prompts,
                                   16)
    diverged = assert_equal_but_near_ties(reference, [list(o.outputs[0].token_ids) for o in outputs])
    assert diverged <= 2, f"{diverged} of {len(prompts)} sequences left transformers' tokens"


def test_tied_embedding_is_quantized_once(tied_path: Path, tmp_path: Path) -> None:
    reference = hf_greedy(_fake_quantized(tied_path, "int4", tmp_path / "twin"), PROMPTS, MAX_TOKENS)
    assert check_logprobs_close(reference, _run(tied_path, quantization="int4"), "tied int4") == 0


@pytest.fixture(scope="module")
def tied_gguf(tied_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tied_path, tmp_path_factory.mktemp("quant-gguf") / "tied-Q4_1.gguf",
                      gguf.GGMLQuantizationType.Q4_1)


@pytest.fixture(scope="module")
def single_device(tied_path: Path, tied_gguf: Path) -> dict[str, list[tuple[list[int], list[dict[int, float]]]]]:
    return {"int4": _run(tied_path, quantization="int4"), "gguf": _run(tied_gguf)}


@pytest.mark.parametrize("source", ["int4", "gguf"])
def test_tp2_on_packed_weights_equals_one_device(ray_cluster: None, tied_path: Path, tied_gguf: Path, source: str,
                                                 single_device: dict[str, list]) -> None:
    """Column-parallel layers split the block rows, row-parallel ones whole blocks of each row, the vocabulary-
    parallel embedding and LM head their rows: TP=2 must generate what one device does."""
    path, settings = (tied_path, {"quantization": "int4"}) if source == "int4" else (tied_gguf, {})
    ours = _run(path, tensor_parallel_size=2, **settings)
    assert_same_output(ours, single_device[source])


@pytest.fixture
def int4_llm(checkpoints: dict[str, Path]) -> Iterator[LLM]:
    llm = LLM(model=str(checkpoints["llama"]), quantization="int4", distributed_executor_backend="uni", **ENGINE)
    yield llm
    llm.shutdown()


def test_sleep_level_2_reloads_packed_weights(int4_llm: LLM) -> None:
    expected = _generate(int4_llm)
    int4_llm.sleep(2)
    int4_llm.wake_up()
    assert_same_output(_generate(int4_llm), expected)


def test_row_parallel_input_must_hold_whole_blocks() -> None:
    config = get_quantization_config("int8", AutoConfig.for_model("llama"))
    with set_quant_config(config), pytest.raises(ValueError, match="48 input features per TP rank, not a multiple"):
        RowParallelLinear(48, 64)


def test_moe_models_are_refused() -> None:
    config = AutoConfig.for_model("mixtral", architectures=["MixtralForCausalLM"])
    with pytest.raises(ValueError, match="experts of MixtralForCausalLM .* not quantized yet"):
        get_quantization_config("int4", config)


@pytest.mark.usefixtures("model_parallel_of_one")  # the layer is built outside an engine
@pytest.mark.parametrize("native_bf16", [True, False], ids=["bf16-dot-products", "no-bf16-dot-products"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_each_path_of_a_quantized_linear(kernel: str, dtype: torch.dtype, native_bf16: bool,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever its plan picks, a Q4_1 linear computes x W^T + b on its dequantized weight: the block kernel, or a
    float kernel on the dequantized copy, float32 for float32 activations and bfloat16 for bfloat16 ones where the
    CPU multiplies bfloat16 (forced off here: a float32 copy, x upcast). A plan of the block kernels alone keeps no
    copy, and so does a layer where AMX runs (a float kernel in its plan then falls back to the block kernel); `amx`
    runs on AMX for bfloat16 activations where the CPU has it, and falls back to the block kernel elsewhere (float32
    activations, no AMX)."""
    if kernels.load() is None or (kernel == "skinny" and cpu_kernels.load() is None):
        pytest.skip("raylm's CPU kernels could not be built here")
    if native_bf16 and not model_info.cpu_multiplies_bf16():
        pytest.skip("no bfloat16 dot products on this CPU")
    monkeypatch.setattr(model_info, "cpu_multiplies_bf16", lambda: native_bf16)
    if not native_bf16:  # a CPU without bfloat16 products has no AMX either: the float copy's paths
        monkeypatch.setattr(kernels, "amx_kernels_for", lambda device, dtype: None)
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(80, 96, generator=generator), torch.randn(80, generator=generator)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with set_quant_config(get_quantization_config("int4", AutoConfig.for_model("llama"))):
            layer = ColumnParallelLinear(96, 80, bias=True)
    finally:
        torch.set_default_dtype(previous)
    layer.weight.weight_loader(layer.weight, weight)
    layer.bias.weight_loader(layer.bias, bias.to(dtype))
    layer.process_weights_after_loading()
    copy_dtype = torch.bfloat16 if dtype == torch.bfloat16 and native_bf16 else torch.float32
    amx = kernels.amx_kernels_for(layer.weight.device, dtype) is not None  # then the blocks alone, never a copy
    assert amx == (layer.dequantized is None)
    assert amx or layer.dequantized.dtype == copy_dtype
    layer.gemm_plan = GemmPlan((kernel,) * len(ROW_BUCKETS))
    layer.process_weights_after_loading()  # what plan_linears does with the plan
    assert (layer.dequantized is None) == (kernel in BLOCK_KERNELS or amx)
    dequantized = dequantize(layer.weight, Q4_1).double()
    # A bfloat16 result, or a bfloat16 copy, rounds to 8 significant bits; float32 sums differ in order only.
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for rows in (1, 5, 13, 40):
        x = torch.randn(rows, 96, generator=generator).to(dtype)
        y = layer(x)
        reference = F.linear(x.double(), dequantized, layer.bias.double())
        assert y.dtype == dtype and y.shape == (rows, 80)
        torch.testing.assert_close(y.double(), reference, rtol=tolerance,
                                   atol=tolerance * reference.abs().max().item())
