"""Speculative decoding end to end (CPU, one device): greedy output with drafts is token for token the output without
them and transformers' (prompt lookup for ngram), for ngram and a draft model at k = 1, 3, 5, and under async
scheduling, chunked prefill, forced preemption, prefix-cache hits and padding to uniform (k + 1)-token decode batches;
seeded sampling, logprobs and logits processors agree with the runs without drafts; every KV block comes back."""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.core.scheduler import Scheduler
from raylm.cluster.tools.draft_checkpoint import make_draft_checkpoint
from tests.reference import assert_same_output, hf_greedy

MAX_TOKENS = 32


def make_prompts() -> list[list[int]]:
    """Passages followed by their first part again (so the output tends to repeat them), two sharing a prefix."""
    rng = random.Random(7)
    prompts = []
    for length in (9, 24, 40, 17, 31):
        passage = [rng.randrange(5, 512) for _ in range(length)]
        prompts.append(passage + passage[: length // 2])
    return prompts + [prompts[2][:20] + prompts[0]]


def ngram(k: int) -> dict[str, Any]:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@dataclass
class Run:
    outputs: list[tuple[list[int], list[dict[int, float]]]]  # per prompt: tokens, logprobs
    scheduler: Scheduler
    num_padded_forwards: int


def generate(path: Path, params: SamplingParams | None = None, **settings: Any) -> Run:
    llm = LLM(model=str(path), max_model_len=256, block_size=16, record_forwards=True, **settings)
    params = params or SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in make_prompts()], params, use_tqdm=False)
    engine_core = llm.llm_engine.engine_core
    scheduler = engine_core.scheduler
    padded = engine_core.collective_rpc("batch_execution_counts")[0]["padded"]
    manager = scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks and manager.req_to_blocks == {}, "KV blocks not returned"
    llm.shutdown()
    results = []
    for output in outputs:
        completion = output.outputs[0]
        logprobs = [dict(position) for position in completion.logprobs or []]
        results.append((list(completion.token_ids), logprobs))
    return Run(results, scheduler, padded)


@pytest.fixture(scope="module")
def draft_path(llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_draft_checkpoint(llama_path, tmp_path_factory.mktemp("draft") / "first-layer", 1)


@pytest.fixture(scope="module")
def reference(llama_path: Path) -> list[tuple[list[int], list[dict[int, float]]]]:
    return generate(llama_path).outputs


@pytest.fixture(scope="module")
def transformers_greedy(llama_path: Path) -> list[list[int]]:
    return [tokens for tokens, _ in hf_greedy(llama_path, make_prompts(), MAX_TOKENS)]


@torch.inference_mode()
def hf_prompt_lookup(path: Path, k: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    results = []
    for prompt in make_prompts():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                             do_sample=False, prompt_lookup_num_tokens=k, pad_token_id=0, eos_token_id=None)
        results.append(out[0, len(prompt):].tolist())
    return results


@pytest.mark.parametrize("k", [1, 3, 5])
def test_ngram_greedy_matches_plain_and_transformers(llama_path: Path, reference: list, k: int) -> None:
    run = generate(llama_path, speculative_config=ngram(k))
    assert_same_output(run.outputs, reference)
    assert [tokens for tokens, _ in run.outputs] == hf_prompt_lookup(llama_path, k)
    stats = run.scheduler.drafts.stats
    assert stats.num_accepted_tokens > 0 and len(stats.num_accepted_tokens_per_pos) == k


@pytest.mark.parametrize("k", [1, 3, 5])
def test_draft_model_greedy_matches_plain_and_transformers(llama_path: Path, draft_path: Path, reference: list,
                                                           transformers_greedy: list[list[int]], k: int) -> None:
    spec = {"method": "draft_model", "num_speculative_tokens": k, "model": str(draft_path)}
    run = generate(llama_path, speculative_config=spec)
    assert_same_output(run.outputs, reference)
    assert [tokens for tokens, _ in run.outputs] == transformers_greedy
    assert run.scheduler.drafts.stats.num_draft_tokens > 0


def test_a_draft_equal_to_the_target_is_always_accepted(llama_path: Path, reference: list,
                                                        tmp_path: Path) -> None:
    """A draft model that is the target itself (every layer) proposes exactly the greedy tokens: the catch-up
    forward, the drafts' positions and their KV slots all line up."""
    copy = make_draft_checkpoint(llama_path, tmp_path / "copy", 2)
    run = generate(llama_path, speculative_config={"method": "draft_model", "num_speculative_tokens": 4,
                                                   "model": str(copy)})
    assert_same_output(run.outputs, reference)
    stats = run.scheduler.drafts.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    assert stats.mean_acceptance_length > 4


SETTINGS = {
    "async": dict(async_scheduling=True),
    "chunked_prefill_preemption": dict(max_num_batched_tokens=24, num_gpu_blocks_override=9),
    "async_chunked_preemption": dict(async_scheduling=True, max_num_batched_tokens=24, num_gpu_blocks_override=9),
    "prefix_cache_hits": dict(enable_prefix_caching=True),
    "padded_uniform_decode": dict(cudagraph_capture_sizes=[4, 8, 16, 32]),
}


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_unchanged_under(llama_path: Path, draft_path: Path, reference: list, method: str,
                                setting: str) -> None:
    spec = ngram(3) if method == "ngram" else {"method": "draft_model", "num_speculative_tokens": 3,
                                               "model": str(draft_path)}
    run = generate(llama_path, speculative_config=spec, **SETTINGS[setting])
    assert_same_output(run.outputs, reference)
    if "preemption" in setting:
        assert run.scheduler.num_preemptions > 0
    if setting == "prefix_cache_hits":
        assert run.scheduler.prefix_cache_hits > 0  # the last prompt starts with another's first block
    if setting == "padded_uniform_decode":
        assert run.num_padded_forwards > 0  # batches of 3 drafts per request padded to a size of 4 x requests


def test_seeded_sampling_matches_plain_sampling_with_ngram(llama_path: Path) -> None:
    """ngram drafts are one-hot: verification takes plain sampling's draw at each output position, so the seeded
    tokens (and logits processors' effects) are those of a run without drafts."""
    params = [SamplingParams(temperature=0.8, top_k=40, seed=11 + i, max_tokens=MAX_TOKENS, ignore_eos=True,
                             repetition_penalty=1.2, min_tokens=3, logprobs=1) for i in range(len(make_prompts()))]
    llm_outputs = []
    for settings in ({}, {"speculative_config": ngram(3)}):
        llm = LLM(model=str(llama_path), max_model_len=256, block_size=16, **settings)
        llm_outputs.append(llm.generate([{"prompt_token_ids": p} for p in make_prompts()], params, use_tqdm=False))
        llm.shutdown()
    plain, spec = ([(list(o.outputs[0].token_ids), [dict(pos)
                                                    for pos in o.outputs[0].logprobs or []]) for o in outputs]
                   for outputs in llm_outputs)
    assert_same_output(spec, plain)


def test_seeded_sampling_with_a_draft_model_repeats(llama_path: Path, draft_path: Path) -> None:
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True)
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(draft_path)}
    first = generate(llama_path, params, speculative_config=spec)
    again = generate(llama_path, params, speculative_config=spec, max_num_batched_tokens=40)
    assert [tokens for tokens, _ in first.outputs] == [tokens for tokens, _ in again.outputs]
    assert again.scheduler.drafts.stats.num_draft_tokens > 0
