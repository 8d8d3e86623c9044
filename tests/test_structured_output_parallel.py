"""Constrained requests under every way of running the engine give the single-device tokens: async scheduling (the
bitmask of a step waits for the step before), chunked prefill with forced preemption (a resumed request keeps its
matcher, never ahead of its tokens), TP=2, PP=2 with async scheduling, and DP=2."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from raylm.cluster import LLM, SamplingParams
from raylm.common.structured_outputs import StructuredOutputsParams
from tests.structured_corpus import CORPUS, closing_bias, validate_json

ENGINE = dict(max_model_len=256, block_size=4, enable_prefix_caching=True)
SCHEMAS = ["github_issue", "product_catalog", "payment", "tree"]


def workload(llm: LLM) -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(5, 500) for _ in range(n)]} for n in (3, 9, 30, 17, 41, 5, 12)]
    tokenizer = llm.get_tokenizer()
    bias = closing_bias(tokenizer, tokenizer.eos_token_id)
    params = [SamplingParams(temperature=0.0, max_tokens=120, logit_bias=bias,
                             structured_outputs=StructuredOutputsParams(json=CORPUS[name], disable_any_whitespace=True))
              for name in SCHEMAS]
    params.append(SamplingParams(temperature=1.0, seed=7, max_tokens=40,
                                 structured_outputs=StructuredOutputsParams(regex="[a-z]{1,6}( [a-z]{1,6}){2,5}")))
    params.append(SamplingParams(temperature=0.8, seed=1, max_tokens=20, n=2,
                                 structured_outputs=StructuredOutputsParams(choice=["alpha", "beta", "gamma delta"])))
    params.append(SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))  # unconstrained, alongside
    return prompts, params


def run(model: Path, **settings: Any) -> list[list[list[int]]]:
    llm = LLM(model=str(model), **{**ENGINE, **settings})
    prompts, params = workload(llm)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for name, output in zip(SCHEMAS, outputs):
        assert output.outputs[0].finish_reason == "stop"
        validate_json(output.outputs[0].text, CORPUS[name])
    core = llm.llm_engine.engine_core
    preemptions = getattr(getattr(core, "scheduler", None), "num_preemptions", 0)
    llm.shutdown()
    if settings.get("num_gpu_blocks_override"):
        assert preemptions > 0
    return [[completion.token_ids for completion in output.outputs] for output in outputs]


@pytest.fixture(scope="module")
def reference(llama_path: Path) -> list[list[list[int]]]:
    return run(llama_path)


@pytest.mark.parametrize("settings", [
    dict(async_scheduling=True),
    dict(max_num_batched_tokens=16, num_gpu_blocks_override=40, enable_prefix_caching=False),
    dict(async_scheduling=True, max_num_batched_tokens=16, num_gpu_blocks_override=40),
], ids=["async", "chunked_preempted", "async_chunked_preempted"])
def test_one_device_settings(llama_path: Path, reference: list, settings: dict) -> None:
    assert run(llama_path, **settings) == reference


@pytest.mark.parametrize("settings", [
    dict(tensor_parallel_size=2),
    dict(pipeline_parallel_size=2, async_scheduling=True),
    dict(data_parallel_size=2),
], ids=["tp2", "pp2_async", "dp2"])
def test_parallel_layouts(ray_cluster: Any, llama_path: Path, reference: list, settings: dict) -> None:
    assert run(llama_path, **settings) == reference
