"""Lock-step data parallel for MoE models with expert parallel: DP=2 (and DP=2 x TP=2) engines share one world, every
forward on every rank joins coordinate_batch_across_dp and the expert all_to_all, and idle ranks run dummy batches.
Outputs equal transformers' and the single device's; one request alone, and very uneven loads, finish without a
hang; every rank ran exactly as many forwards as DP coordinations, and as many as every other rank."""
from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.dp.dp_client import DPEngineCoreClient
from tests.reference import TOP_K, assert_same_output, check_logprobs_close, hf_greedy

MAX_TOKENS = 8
# record_forwards: the workers count their forwards (assert_lockstep; test_dbo's batch_execution_counts).
ENGINE = dict(max_model_len=256, block_size=16, max_num_seqs=8, num_gpu_blocks_override=64,
              enable_prefix_caching=False, record_forwards=True)
Result = list[tuple[list[int], list[dict[int, float]]]]

pytestmark = pytest.mark.slow



def make_prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(5, 512) for _ in range(n)] for n in (1, 9, 30, 64, 3)]


def generate(llm: LLM, prompts: list[list[int]], max_tokens: list[int] | None = None) -> Result:
    max_tokens = max_tokens or [MAX_TOKENS] * len(prompts)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=TOP_K) for n in max_tokens]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def assert_lockstep(llm: LLM, world_size: int) -> None:
    """Every worker of every engine ran one DP coordination per forward and, once the wave is over (its dummy steps
    end at the next "anything left?" check), all ran the same number."""
    deadline = time.monotonic() + 30
    while True:
        counts = llm.collective_rpc("forward_counts")
        assert len(counts) == world_size
        assert all(forwards == coordinations > 0 for forwards, coordinations in counts), counts
        if len(set(counts)) == 1:
            return
        assert time.monotonic() < deadline, f"ranks never agreed: {counts}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def single_device(moe_checkpoints: dict[str, Path]) -> dict[str, Result]:
    results = {}
    for arch, path in moe_checkpoints.items():
        llm = LLM(model=str(path), **ENGINE)
        results[arch] = generate(llm, make_prompts())
        llm.shutdown()
    return results


@pytest.fixture(scope="module")
def mixtral_dp2(ray_cluster: Any, moe_checkpoints: dict[str, Path]) -> Iterator[LLM]:
    llm = LLM(model=str(moe_checkpoints["mixtral"]), data_parallel_size=2, enable_expert_parallel=True, **ENGINE)
    client = llm.llm_engine.engine_core
    assert isinstance(client, DPEngineCoreClient) and client.lockstep
    yield llm
    llm.shutdown()


def test_dp2_ep_matches_transformers_and_one_device(mixtral_dp2: LLM, moe_checkpoints: dict[str, Path],
                                                    single_device: dict[str, Result]) -> None:
    ours = generate(mixtral_dp2, make_prompts())
    assert_same_output(ours, single_device["mixtral"])
    assert check_logprobs_close(hf_greedy(moe_checkpoints["mixtral"], make_prompts(), MAX_TOKENS), ours,
                                "mixtral dp2 ep") <= 1
    assert_lockstep(mixtral_dp2, world_size=2)


def test_one_request_alone_runs_against_dummy_batches(mixtral_dp2: LLM, single_device: dict[str, Result]) -> None:
    for prompt_index in (0, 3):  # a fresh wave each time: the other engine is idle when it arrives
        ours = generate(mixtral_dp2, [make_prompts()[prompt_index]])
        assert_same_output(ours, [single_device["mixtral"][prompt_index]])
    assert_lockstep(mixtral_dp2, world_size=2)


def test_very_uneven_loads(mixtral_dp2: LLM, moe_checkpoints: dict[str, Path]) -> None:
    rng = random.Random(9)
    prompts = [[rng.randrange(5, 512) for _ in range(n)] for n in (200, 1, 1, 120, 2, 1)]
    max_tokens = [40, 1, 2, 30, 1, 3]
    ours = generate(mixtral_dp2, prompts, max_tokens)
    assert [len(tokens) for tokens, _ in ours] == max_tokens
    single = LLM(model=str(moe_checkpoints["mixtral"]), **ENGINE)
    assert_same_output(ours, generate(single, prompts, max_tokens))
    single.shutdown()
    assert_lockstep(mixtral_dp2, world_size=2)


def test_sleep_right_after_generate_waits_for_the_wave(mixtral_dp2: LLM, single_device: dict[str, Result]) -> None:
    """generate returns while the engines still run the wave's dummy steps (up to WAVE_CHECK_STEPS of them): a sleep
    then must not free the weights those forwards read (the runner asserts no forward runs asleep, which would end
    the engine)."""
    for _ in range(3):
        ours = generate(mixtral_dp2, [make_prompts()[1]])
        mixtral_dp2.sleep(level=1)
        assert mixtral_dp2.llm_engine.engine_core.is_sleeping()
        mixtral_dp2.wake_up()
        assert_same_output(ours, [single_device["mixtral"][1]])
    assert_lockstep(mixtral_dp2, world_size=2)


def test_qwen3_moe_dp2_by_tp2_ep_matches_one_device(ray_cluster: Any, moe_checkpoints: dict[str, Path],
                                                     single_device: dict[str, Result]) -> None:
    llm = LLM(model=str(moe_checkpoints["qwen3_moe"]), data_parallel_size=2, tensor_parallel_size=2,
              enable_expert_parallel=True, **ENGINE)
    try:
        assert_same_output(generate(llm, make_prompts()), single_device["qwen3_moe"])
        assert_lockstep(llm, world_size=4)
    finally:
        llm.shutdown()


def test_settings_lock_step_cannot_honour(ray_cluster: Any, llama_path: Path,
                                          moe_checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="enable_expert_parallel: LlamaForCausalLM has no experts"):
        LLM(model=str(llama_path), data_parallel_size=2, enable_expert_parallel=True, **ENGINE)
    with pytest.raises(ValueError, match="async_scheduling is not supported"):
        LLM(model=str(moe_checkpoints["mixtral"]), data_parallel_size=2, enable_expert_parallel=True,
            async_scheduling=True, **ENGINE)
    with pytest.raises(ValueError, match="4 experts cannot be split evenly over 3"):
        LLM(model=str(moe_checkpoints["mixtral"]), data_parallel_size=3, enable_expert_parallel=True, **ENGINE)
