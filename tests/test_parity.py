"""raylm's greedy output equals transformers' on Llama, Qwen2 and Qwen3 checkpoints, whatever the
scheduler does: all prompts in one step, chunked prefill, or two requests at a time."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from raylm.cluster import LLM, SamplingParams
from tests.reference import TOP_K, check_logprobs_close, hf_greedy

MAX_TOKENS = 32
PROMPT_LENGTHS = [1, 3, 7, 16, 17, 40, 99, 200]
SCHEDULES = {
    "one_step": dict(max_num_batched_tokens=1024, max_num_seqs=16),
    "chunked_prefill": dict(max_num_batched_tokens=32, max_num_seqs=16),
    "two_at_a_time": dict(max_num_batched_tokens=1024, max_num_seqs=2),
    "long_prefill_slices": dict(max_num_batched_tokens=1024, max_num_seqs=16, long_prefill_token_threshold=24),
    # The plain-torch layers and attention backend, which run wherever raylm's CPU kernels do not.
    "chunked_prefill_plain_torch": dict(max_num_batched_tokens=32, max_num_seqs=16, custom_ops="none"),
}


def make_prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(5, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def references(checkpoints: dict[str, Path]) -> dict[str, list]:
    return {arch: hf_greedy(path, make_prompts(512), MAX_TOKENS) for arch, path in checkpoints.items()}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_transformers(arch: str, schedule: str, checkpoints: dict[str, Path],
                                     references: dict[str, list]) -> None:
    llm = LLM(model=str(checkpoints[arch]), max_model_len=512, block_size=16, enable_prefix_caching=False,
              **SCHEDULES[schedule])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)
    outputs = llm.generate([{"prompt_token_ids": p} for p in make_prompts(512)], params, use_tqdm=False)
    ours = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]
    diverged = check_logprobs_close(references[arch], ours, f"{arch}/{schedule}")
    # Random tiny weights give near-ties now and then; most sequences must still match exactly.
    assert diverged <= 2, f"{diverged} of {len(ours)} sequences diverged"
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    llm.shutdown()
