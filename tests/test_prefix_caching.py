"""Prefix caching end to end: the same greedy tokens with it on and off on a shared-prefix workload, cached blocks
reused within and across generate calls, every block back in the pool, and reset_prefix_cache."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from raylm.cluster import LLM, RequestOutput, SamplingParams
from raylm.cluster.core.scheduler import Scheduler

BLOCK_SIZE = 16
PREFIX_LEN = 56  # three full blocks and a partial one
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
SCHEDULES = {
    "one_step": dict(max_num_batched_tokens=1024, max_num_seqs=16),
    "chunked_prefill": dict(max_num_batched_tokens=32, max_num_seqs=16),
    "two_at_a_time": dict(max_num_batched_tokens=1024, max_num_seqs=2),
}


def make_prompts() -> list[list[int]]:
    rng = random.Random(0)
    prefix = [rng.randrange(5, 512) for _ in range(PREFIX_LEN)]
    return [prefix + [rng.randrange(5, 512) for _ in range(n)] for n in (1, 5, 9, 16, 23, 30)]


def run(llm: LLM, prompts: list[list[int]]) -> list[RequestOutput]:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)


def scheduler_of(llm: LLM) -> Scheduler:
    return llm.llm_engine.engine_core.scheduler


def assert_pool_empty(llm: LLM) -> None:
    manager = scheduler_of(llm).kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)


@pytest.fixture(scope="module")
def uncached(llama_path: Path) -> list[RequestOutput]:
    llm = LLM(model=str(llama_path), max_model_len=256, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    outputs = run(llm, make_prompts())
    assert scheduler_of(llm).prefix_cache_queries == scheduler_of(llm).prefix_cache_hits == 0
    llm.shutdown()
    return outputs


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_cached_outputs_equal_uncached(llama_path: Path, uncached: list[RequestOutput], schedule: str) -> None:
    llm = LLM(model=str(llama_path), max_model_len=256, block_size=BLOCK_SIZE, **SCHEDULES[schedule])
    scheduler = scheduler_of(llm)
    prompts = make_prompts()
    for attempt in range(2):  # the second call finds every prompt's blocks cached, freed but not evicted
        hits_before = scheduler.prefix_cache_hits
        outputs = run(llm, prompts)
        assert scheduler.prefix_cache_hits > hits_before
        assert_pool_empty(llm)
        for ours, reference in zip(outputs, uncached):
            assert ours.outputs[0].token_ids == reference.outputs[0].token_ids
            for position, expected in zip(ours.outputs[0].logprobs or [], reference.outputs[0].logprobs or []):
                assert position.keys() == expected.keys()
                assert all(abs(position[t] - expected[t]) < 1e-4 for t in expected)
        if attempt == 1:
            full_blocks = [(len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts]
            assert [o.num_cached_tokens for o in outputs] == full_blocks
            assert scheduler.prefix_cache_hits - hits_before == sum(full_blocks)
    llm.shutdown()


def test_reset_prefix_cache(llama_path: Path) -> None:
    llm = LLM(model=str(llama_path), max_model_len=256, block_size=BLOCK_SIZE)
    scheduler = scheduler_of(llm)
    prompt = make_prompts()[-1]
    [first] = run(llm, [prompt])
    assert first.num_cached_tokens == 0 and scheduler.prefix_cache_queries == len(prompt)
    [cached] = run(llm, [prompt])
    assert cached.num_cached_tokens == 80 and scheduler.prefix_cache_hits == 80
    assert scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
    assert llm.reset_prefix_cache() is True
    assert not scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
    [recomputed] = run(llm, [prompt])
    assert recomputed.num_cached_tokens == 0 and scheduler.prefix_cache_hits == 80
    assert first.outputs[0].token_ids == cached.outputs[0].token_ids == recomputed.outputs[0].token_ids
    assert_pool_empty(llm)
    llm.shutdown()
