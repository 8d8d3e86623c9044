"""Data parallel with a dense model: DP engines are independent Ray actors behind one load-aware client. DP=2 gives
DP=1's tokens from two real engines, requests spread by load (not round robin), a dead engine fails only its own
requests with an error naming it, and /metrics-style stats carry an engine label."""
from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import pytest
import ray

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.dp.dp_client import DPEngineCoreClient
from raylm.cluster.dp.dp_load_balancer import DPLoadBalancer
from raylm.cluster.engine.async_llm import AsyncLLM
from raylm.cluster.engine.outputs import DPEngineDiedError, EngineDeadError
from raylm.cluster.entrypoints.openai.metrics import PrometheusStatLogger
from raylm.configs import make_engine_config
from tests.reference import TOP_K, assert_same_output

MAX_TOKENS = 10
ENGINE = dict(max_model_len=256, block_size=16, max_num_seqs=8, num_gpu_blocks_override=64,
              enable_prefix_caching=False)
Result = list[tuple[list[int], list[dict[int, float]]]]



def make_prompts(n: int = 6, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 512) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def generate(llm: LLM, prompts: list[list[int]]) -> Result:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def client_of(llm: LLM) -> DPEngineCoreClient:
    client = llm.llm_engine.engine_core
    assert isinstance(client, DPEngineCoreClient)
    return client


def test_load_balancer_prefers_the_least_loaded_engine() -> None:
    balancer = DPLoadBalancer(3)
    assert [balancer.choose() for _ in range(3)] == [0, 1, 2]  # a burst spreads before any report
    balancer.on_report(0, num_waiting=0, num_running=5, num_received=1)
    balancer.on_report(1, num_waiting=2, num_running=0, num_received=1)
    balancer.on_report(2, num_waiting=0, num_running=1, num_received=1)
    assert balancer.scores() == [5, 8, 1]
    assert balancer.choose() == 2  # then its score is 1 + 4 for the request in flight
    assert balancer.choose() == 0
    balancer.mark_dead(2)
    assert balancer.choose() == 1


def test_dense_dp2_equals_dp1_from_two_engines(ray_cluster: Any, llama_path: Path) -> None:
    prompts = make_prompts()
    single = LLM(model=str(llama_path), **ENGINE)
    reference = generate(single, prompts)
    single.shutdown()

    llm = LLM(model=str(llama_path), data_parallel_size=2, **ENGINE)
    try:
        client = client_of(llm)
        assert client.num_engines == 2 and not client.lockstep
        assert_same_output(generate(llm, prompts), reference)
        # Each engine says how many requests it took in: both served.
        assert [load.num_received for load in client.balancer.engines] == [3, 3]
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_dense_dp2_by_pp2_equals_dp1(ray_cluster: Any, llama_path: Path) -> None:
    """DP composes with PP: two engines, each a 2-stage pipeline of Worker actors in its own placement group."""
    prompts = make_prompts(4, seed=8)
    single = LLM(model=str(llama_path), **ENGINE)
    reference = generate(single, prompts)
    single.shutdown()
    llm = LLM(model=str(llama_path), data_parallel_size=2, pipeline_parallel_size=2, record_forwards=True, **ENGINE)
    try:
        assert_same_output(generate(llm, prompts), reference)
        assert len(llm.collective_rpc("forward_counts")) == 4  # 2 engines x 2 stages
        assert [load.num_received for load in client_of(llm).balancer.engines] == [2, 2]
    finally:
        llm.shutdown()


def test_skewed_stream_spreads_by_load_not_round_robin(ray_cluster: Any, llama_path: Path) -> None:
    llm = LLM(model=str(llama_path), data_parallel_size=2, **ENGINE)
    engine = llm.llm_engine
    client = client_of(llm)
    try:
        prompt = {"prompt_token_ids": [5, 6, 7, 8]}
        _, long_engine = engine.add_request("long", prompt, SamplingParams(max_tokens=200, ignore_eos=True))
        _, short_engine = engine.add_request("short", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        assert (long_engine, short_engine) == (0, 1)
        deadline = time.monotonic() + 30
        while client.stats[1].num_running_reqs or client.balancer.engines[1].num_received < 1 \
                or client.stats[0].num_running_reqs != 1 or "short" in client.request_engine:
            assert time.monotonic() < deadline, "the short request did not finish"
            engine.step()
        # Engine 0 is busy with the long request, engine 1 idle: round robin would give 0, 1, 0.
        chosen = [engine.add_request(f"next{i}", prompt, SamplingParams(max_tokens=2))[1] for i in range(3)]
        assert chosen == [1, 0, 1], client.balancer.scores()
        engine.abort_request(["long"])
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        llm.shutdown()


def test_a_dead_engine_fails_only_its_requests(ray_cluster: Any, llama_path: Path) -> None:
    llm = LLM(model=str(llama_path), data_parallel_size=2, **ENGINE)
    engine = llm.llm_engine
    client = client_of(llm)
    try:
        params = SamplingParams(max_tokens=60, ignore_eos=True)
        placed = {f"r{i}": engine.add_request(f"r{i}", {"prompt_token_ids": [9, i + 5]}, params)[1]
                  for i in range(4)}
        engine.step()
        ray.kill(client.actors[1])
        killed_at = time.monotonic()
        finished: set[str] = set()
        errors: list[DPEngineDiedError] = []
        while engine.has_unfinished_requests():
            try:
                finished.update(o.request_id for o in engine.step() if o.finished)
            except DPEngineDiedError as err:
                errors.append(err)
                assert time.monotonic() - killed_at < 10
        assert len(errors) == 1 and "DP engine 1" in str(errors[0]) and not errors[0].fatal
        assert sorted(errors[0].request_ids) == sorted(r for r, e in placed.items() if e == 1)
        assert finished == {r for r, e in placed.items() if e == 0}
        with pytest.raises(RuntimeError, match="DP engine 1"):
            client.check_health()
        # The live engine keeps serving new requests.
        assert engine.add_request("after", {"prompt_token_ids": [5]}, SamplingParams(max_tokens=2))[1] == 0
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        llm.shutdown()


def test_async_llm_streams_from_both_engines_with_engine_labels(ray_cluster: Any, llama_path: Path) -> None:
    config = make_engine_config(model=str(llama_path), data_parallel_size=2, **ENGINE)
    metrics = PrometheusStatLogger("tiny")
    llm = AsyncLLM(config, stat_loggers=[metrics])

    async def run() -> list[list[int]]:
        await llm.wait_until_ready()

        async def one(i: int) -> list[int]:
            tokens: list[int] = []
            params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
            async for output in llm.generate(f"req{i}", {"prompt_token_ids": [7, i + 5]}, params):
                tokens += output.outputs[0].token_ids
            return tokens

        results = await asyncio.gather(*[one(i) for i in range(4)])
        await llm.check_health()
        return results

    try:
        results = asyncio.run(run())
    finally:
        llm.shutdown()
        with pytest.raises(EngineDeadError):
            asyncio.run(llm.check_health())
    assert all(len(tokens) == 5 for tokens in results)
    text = metrics.exposition().decode()
    for engine in ("0", "1"):
        line = f'vllm:generation_tokens_total{{engine="{engine}",model_name="tiny"}} 10.0'
        assert line in text, text
