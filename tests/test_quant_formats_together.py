"""A quantized checkpoint as shipped together with the rest: LoRA over its quantized base (against PEFT over the
same weights dequantized by transformers' compressed-tensors integration), speculative decoding with it as the target
(a float draft; greedy output equal to the target's own), TP=2 and PP=2 on Ray (equal to one device)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.models.tiny_model import make_tiny_model
from raylm.common.lora_request import LoRARequest
from tests.lora_utils import make_adapter, peft_greedy
from tests.quant_format_checkpoints import write_compressed_tensors, write_gptq
from tests.reference import TOP_K, assert_same_output, check_logprobs_close

MAX_TOKENS = 8
PROMPTS = [[5, 17, 33, 400, 12], list(range(10, 40)), [300, 301, 300, 301, 300], [7]]
ENGINE = dict(dtype="float32", max_model_len=128, block_size=16, enable_prefix_caching=False)
Result = list[tuple[list[int], list[dict[int, float]]]]


@pytest.fixture(scope="module")
def float_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("qt") / "float", num_layers=2, hidden_size=64,
                           intermediate_size=128, vocab_size=512)


def run(path: Path, lora_request: LoRARequest | None = None, **settings: object) -> tuple[Result, LLM]:
    llm = LLM(model=str(path), **ENGINE, **settings)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False,
                           lora_request=lora_request)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs], llm


def test_lora_over_a_quantized_base_matches_peft(float_path: Path, tmp_path: Path) -> None:
    ct = write_compressed_tensors(float_path, "w4a16-group-asym", tmp_path / "ct")
    twin = tmp_path / "twin"  # the base as transformers' compressed-tensors integration dequantizes it
    dequantized = AutoModelForCausalLM.from_pretrained(
        ct, dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False))
    base = AutoModelForCausalLM.from_pretrained(float_path, dtype=torch.float32)
    base.load_state_dict({name: t for name, t in dequantized.state_dict().items() if name in base.state_dict()})
    base.save_pretrained(twin)
    adapter = make_adapter(float_path, tmp_path / "adapter", seed=1, r=8)
    ours, llm = run(ct, LoRARequest("a", 1, str(adapter)), enable_lora=True, max_lora_rank=8)
    llm.shutdown()
    assert check_logprobs_close(peft_greedy(twin, adapter, PROMPTS, MAX_TOKENS), ours, "lora over ct") <= 1


def test_speculative_decoding_with_a_quantized_target(float_path: Path, tmp_path: Path) -> None:
    """The target in GPTQ's activation order (input permutation), a float draft: the draft's proposals are checked
    against the quantized target, so the output is the target's own greedy output."""
    gptq = write_gptq(float_path, tmp_path / "gptq", desc_act=True, sym=False)
    plain, llm = run(gptq)
    llm.shutdown()
    spec, llm = run(gptq, speculative_config={"method": "draft_model", "num_speculative_tokens": 3,
                                              "model": str(float_path)})
    stats = llm.llm_engine.engine_core.scheduler.drafts.stats
    llm.shutdown()
    assert_same_output(spec, plain)
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_parallel_layouts_match_one_device(ray_cluster: None, float_path: Path, tmp_path: Path,
                                           layout: dict[str, int]) -> None:
    """TP=2 shards the repacked blocks: o_proj's 32 inputs per rank split a group of 64 across the ranks, each block
    carrying its group's scale and zero point. PP=2: each stage repacks only its own layers' tensors."""
    ct = write_compressed_tensors(float_path, "w4a16-group-asym", tmp_path / "ct")
    one, llm = run(ct)
    llm.shutdown()
    two, llm = run(ct, distributed_executor_backend="ray", **layout)
    llm.shutdown()
    assert_same_output(two, one)
