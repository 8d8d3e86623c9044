"""Each checkpoint format with the rest, beyond test_quant_formats_together.py's cases: LoRA over every other kind of
quantized base (activation order, quantized activations, FP8, AWQ) against PEFT over transformers running the same
folder; a quantized checkpoint as the speculative draft; disaggregated prefill (the KV connector) between two engines
of one quantized checkpoint."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.engine.config_resolver import resolve_engine_config
from raylm.cluster.models.tiny_model import make_tiny_model
from raylm.common.lora_request import LoRARequest
from raylm.configs import make_engine_config
from tests.lora_utils import make_adapter
from tests.quant_format_checkpoints import write_awq, write_compressed_tensors, write_gptq
from tests.reference import TOP_K, assert_same_output, check_logprobs_close, model_greedy

MAX_TOKENS = 6
PROMPTS = [[5, 17, 33, 400, 12], list(range(10, 40)), [300, 301, 300, 301, 300]]
ENGINE = dict(dtype="float32", max_model_len=128, block_size=16, enable_prefix_caching=False)
Result = list[tuple[list[int], list[dict[int, float]]]]


@pytest.fixture(scope="module")
def float_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("qc") / "float", num_layers=2, hidden_size=64,
                           intermediate_size=128, vocab_size=512)


@pytest.fixture(scope="module")
def gptq_path(float_path: Path) -> Path:
    """GPTQ in activation order (the one format that permutes the layer's input), for the LoRA and KV cases."""
    return write_gptq(float_path, float_path.parent / "gptq-desc_act", desc_act=True, sym=False)


def write(name: str, float_path: Path, out: Path) -> Path:
    if name == "awq":
        return write_awq(float_path, out)
    return write_compressed_tensors(float_path, name, out)


def run(path: Path, lora_request: LoRARequest | None = None, **settings: object) -> tuple[Result, LLM]:
    llm = LLM(model=str(path), **ENGINE, **settings)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False,
                           lora_request=lora_request)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs], llm


@pytest.mark.parametrize("name", ["gptq-desc_act", "awq", "w8a8-int", "fp8-channel"])
def test_lora_over_each_format_matches_peft(float_path: Path, gptq_path: Path, tmp_path: Path, name: str) -> None:
    """PEFT's LoRA over the layers transformers runs the folder with (compressed-tensors' CompressedLinear, which
    quantizes activations per token; GPTQModel's CPU GPTQ / AWQ kernels): the adapter adds to the quantized layer's
    output from the unquantized input, as raylm's LoRA slots do."""
    path = gptq_path if name == "gptq-desc_act" else write(name, float_path, tmp_path / name)
    adapter = make_adapter(float_path, tmp_path / "adapter", seed=2, r=8)
    ours, llm = run(path, LoRARequest("a", 1, str(adapter)), enable_lora=True, max_lora_rank=8)
    llm.shutdown()
    settings: dict[str, Any] = {"device_map": "cpu"}
    if name.startswith(("w8a8", "fp8")):
        settings = {"quantization_config": CompressedTensorsConfig(run_compressed=True)}
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **settings).eval()
    with torch.inference_mode():
        expected = model_greedy(PeftModel.from_pretrained(base, adapter).eval(), PROMPTS, MAX_TOKENS)
    assert check_logprobs_close(expected, ours, f"lora over {name}") <= 1


def test_quantized_draft_model(float_path: Path, tmp_path: Path) -> None:
    """A draft checkpoint quantized as shipped loads by its own format (not the target's): the output is the float
    target's own greedy output, with some of the draft's (the target's int4 twin) tokens accepted."""
    draft = write_compressed_tensors(float_path, "w4a16-group-sym", tmp_path / "draft")
    plain, llm = run(float_path)
    llm.shutdown()
    spec, llm = run(float_path, speculative_config={"method": "draft_model", "num_speculative_tokens": 3,
                                                    "model": str(draft)})
    stats = llm.llm_engine.engine_core.scheduler.drafts.stats
    llm.shutdown()
    assert_same_output(spec, plain)
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0


@pytest.mark.parametrize("case", ["unknown scheme", "tp 2"])
def test_quantized_draft_refused_by_name_before_loading(float_path: Path, tmp_path: Path, case: str) -> None:
    """A draft whose scheme raylm does not run, and a quantized draft at TP 2 (its sharding untested), are refused at
    resolution naming speculative_config.model."""
    if case == "unknown scheme":
        draft = tmp_path / "draft"
        shutil.copytree(float_path, draft)
        config = json.loads((draft / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
        (draft / "config.json").write_text(json.dumps(config))
        settings: dict[str, Any] = {}
        match = r"speculative_config.model: the draft's quantization_config.quant_method 'bitsandbytes'"
    else:
        draft = write_compressed_tensors(float_path, "w4a16-group-sym", tmp_path / "draft")
        settings = {"tensor_parallel_size": 2}
        match = r"speculative_config.model: a draft quantized as shipped .* tensor_parallel_size 1 only, not 2"
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": str(draft)}
    with pytest.raises(ValueError, match=match):
        resolve_engine_config(make_engine_config(model=str(float_path), device="cpu", max_model_len=128,
                                                 speculative_config=spec, **settings))


def test_disaggregated_prefill_of_a_quantized_checkpoint(ray_cluster: None, gptq_path: Path) -> None:
    """A prefill engine and a decode engine of one GPTQ (activation order) folder share KV: the decode engine takes
    every prompt token's KV but the last, and its tokens are the colocated engine's."""
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prefill_only = SamplingParams(temperature=0.0, max_tokens=1,
                                  extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    settings = dict(model=str(gptq_path), kv_connector="RayKVConnector", **ENGINE)
    prefill, decode = LLM(kv_role="kv_producer", **settings), LLM(kv_role="kv_consumer", **settings)
    try:
        expected = [o.outputs[0].token_ids for o in prefill.generate(prompts, greedy, use_tqdm=False)]
        done = prefill.generate(prompts, prefill_only, use_tqdm=False)
        per_prompt = [replace(greedy, extra_args={"kv_transfer_params": o.kv_transfer_params}) for o in done]
        tracker = decode.llm_engine.engine_core.scheduler.kv_transfers
        assert tracker is not None
        outputs = decode.generate(prompts, per_prompt, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert tracker.num_received_tokens == sum(len(p) - 1 for p in PROMPTS)
    finally:
        prefill.shutdown()
        decode.shutdown()
