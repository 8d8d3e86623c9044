"""YaRN rope scaling on a Llama checkpoint, token-exact with transformers on prompts inside and past the original
context."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.models.tiny_model import make_tiny_model
from tests.reference import TOP_K, check_logprobs_close, hf_greedy
from tests.rope_checkpoints import widen_weights, with_config

MAX_TOKENS = 8
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 16.0}


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(5, 500) for _ in range(n)] for n in (5, 40, 90)]


@pytest.fixture(scope="module")
def yarn_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_model(tmp_path_factory.mktemp("yarn") / "llama", arch="llama", vocab_size=512,
                           max_position_embeddings=128, rope_scaling=YARN)
    widen_weights(path)
    return path


def test_greedy_matches_transformers(yarn_llama: Path) -> None:
    reference = hf_greedy(yarn_llama, prompts(), MAX_TOKENS)
    llm = LLM(model=str(yarn_llama), max_model_len=128, block_size=16, enable_prefix_caching=False,
              max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    llm.shutdown()
    ours = [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs]
    assert check_logprobs_close(reference, ours, "yarn") == 0
    # The scaling decides tokens here: without it transformers' differ, so the parity above would catch a wrong ramp.
    plain = with_config(yarn_llama, yarn_llama.parent / "plain", rope_parameters={"rope_type": "default"})
    assert [t for t, _ in hf_greedy(plain, prompts(), MAX_TOKENS)] != [t for t, _ in reference]
