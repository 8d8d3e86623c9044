"""Preemption and scheduling policy end to end: a KV pool too small for the batch preempts and recomputes without
changing greedy outputs, requests that could never fit are refused, and priorities order the work."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from raylm.cluster import LLM, RequestOutput, SamplingParams
from raylm.cluster.core.scheduler import Scheduler

BLOCK_SIZE = 16
MAX_TOKENS = 40


def make_prompts() -> list[list[int]]:
    """Six prompts, two pairs sharing a prefix, each growing to 4 blocks."""
    rng = random.Random(1)
    shared = [rng.randrange(5, 512) for _ in range(16)]
    prompts = [[rng.randrange(5, 512) for _ in range(n)] for n in (9, 17, 20, 23)]
    return prompts + [shared + prompts[0], shared + prompts[0][:3]]


def run(llm: LLM, priority: list[int] | None = None) -> list[RequestOutput]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in make_prompts()], params, use_tqdm=False, priority=priority)


def scheduler_of(llm: LLM) -> Scheduler:
    return llm.llm_engine.engine_core.scheduler


@pytest.fixture(scope="module")
def ample(llama_path: Path) -> list[list[int]]:
    llm = LLM(model=str(llama_path), max_model_len=128, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    outputs = run(llm)
    assert scheduler_of(llm).num_preemptions == 0
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize(("policy", "priority", "settings"), [
    ("fcfs", None, {}),
    ("fcfs", None, dict(max_num_batched_tokens=24, enable_prefix_caching=False)),
    ("priority", [3, 0, 2, 1, 0, 5], {}),
])
def test_preemption_keeps_greedy_outputs(llama_path: Path, ample: list[list[int]], policy: str,
                                         priority: list[int] | None, settings: dict) -> None:
    # 10 blocks hold two or three of the six requests at their full length.
    llm = LLM(model=str(llama_path), max_model_len=128, block_size=BLOCK_SIZE, num_gpu_blocks_override=10,
              scheduling_policy=policy, **settings)
    outputs = run(llm, priority)
    scheduler = scheduler_of(llm)
    assert scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == ample
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    manager = scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks == 10
    llm.shutdown()


def test_prompt_logprobs_survive_preemption(llama_path: Path) -> None:
    """Requests preempted in the middle of their chunked prompt score it again from the start; those preempted
    later keep what they reported. Either way each prompt's logprobs arrive once, as without preemption."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=2)
    results = []
    for num_blocks in (None, 10):
        llm = LLM(model=str(llama_path), max_model_len=128, block_size=BLOCK_SIZE, max_num_batched_tokens=24,
                  num_gpu_blocks_override=num_blocks)
        results.append(llm.generate([{"prompt_token_ids": p} for p in make_prompts()], params, use_tqdm=False))
        assert (scheduler_of(llm).num_preemptions > 0) == (num_blocks is not None)
        llm.shutdown()
    for ample_output, preempted_output in zip(*results):
        assert preempted_output.outputs[0].token_ids == ample_output.outputs[0].token_ids
        expected, ours = ample_output.prompt_logprobs, preempted_output.prompt_logprobs
        assert ours is not None and expected is not None and len(ours) == len(expected)
        for position, reference in zip(ours[1:], expected[1:]):
            assert position is not None and reference is not None and position.keys() == reference.keys()
            assert all(abs(position[t] - reference[t]) < 1e-4 for t in reference)


def test_requests_that_can_never_fit_are_refused(llama_path: Path) -> None:
    llm = LLM(model=str(llama_path), max_model_len=128, block_size=BLOCK_SIZE, num_gpu_blocks_override=4)
    prompt = {"prompt_token_ids": list(range(10, 50))}
    with pytest.raises(ValueError, match=r"can never fit in the KV cache: 40 prompt tokens \+ up to 40 generated "
                                         r"need 5 blocks of 16 tokens, the pool has 4"):
        llm.generate(prompt, SamplingParams(max_tokens=40), use_tqdm=False)
    with pytest.raises(ValueError, match="the prompt has 128 tokens but max_model_len is 128"):
        llm.generate({"prompt_token_ids": list(range(10, 138))}, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    [output] = llm.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)  # 4 blocks
    assert len(output.outputs[0].token_ids) == 24
    llm.shutdown()


def test_priority_order_end_to_end(llama_path: Path) -> None:
    llm = LLM(model=str(llama_path), max_model_len=128, block_size=BLOCK_SIZE, max_num_seqs=1,
              scheduling_policy="priority")
    engine = llm.llm_engine
    priorities = {"a": 2, "b": 0, "c": 3, "d": 1, "e": 0}
    for request_id, priority in priorities.items():
        engine.add_request(request_id, {"prompt_token_ids": [7, 8, 9]}, SamplingParams(max_tokens=3), priority)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["b", "e", "d", "a", "c"]  # by priority, then arrival
    llm.shutdown()


def test_priority_needs_the_priority_policy(llama_path: Path) -> None:
    llm = LLM(model=str(llama_path), max_model_len=128, block_size=BLOCK_SIZE)
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        llm.generate(["hello", "world"], use_tqdm=False, priority=[1, 0])
    assert len(llm.generate(["hello", "world"], use_tqdm=False, priority=[0, 0])) == 2
    llm.shutdown()
