"""Sampling parameters end to end through LLM.generate on a tiny Llama: logprobs and prompt logprobs against
transformers' log-softmax, parallel sampling, penalties, min_tokens, logit bias and stop strings."""
from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from raylm.cluster import LLM, RequestOutput, SamplingParams

TOLERANCE = 1e-4
NUM_LOGPROBS = 4


@pytest.fixture(scope="module")
def llm(llama_path: Path) -> Iterator[LLM]:
    engine = LLM(model=str(llama_path), max_model_len=256, block_size=16)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_model(llama_path: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_logprobs(model: PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab]: row i is the log-softmax of the logits after token_ids[: i + 1]."""
    return model(torch.tensor([token_ids])).logits[0].float().log_softmax(dim=-1)


def make_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 512) for _ in range(n)] for n in lengths]


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def assert_top_logprobs(ours: dict[int, float], reference: torch.Tensor, actual_token: int, n: int) -> None:
    """`ours` holds the actual token and the top n, each within TOLERANCE of the reference row."""
    expected_ids = {actual_token, *reference.topk(n).indices.tolist()}
    assert set(ours) == expected_ids
    for token_id, logprob in ours.items():
        assert abs(logprob - reference[token_id].item()) < TOLERANCE, (token_id, logprob, reference[token_id])


def test_logprobs_of_greedy_tokens_match_transformers(llm: LLM, hf_model: PreTrainedModel) -> None:
    prompts = make_prompts([3, 20, 41])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=NUM_LOGPROBS)
    for prompt, output in zip(prompts, generate(llm, prompts, params)):
        completion = output.outputs[0]
        assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids) == 8
        reference = hf_logprobs(hf_model, prompt + completion.token_ids)
        for i, (token_id, logprobs) in enumerate(zip(completion.token_ids, completion.logprobs)):
            row = reference[len(prompt) - 1 + i]
            assert token_id == row.argmax().item()
            assert_top_logprobs(logprobs, row, token_id, NUM_LOGPROBS)
        assert output.prompt_logprobs is None


@pytest.mark.parametrize("max_num_batched_tokens", [1024, 16])
def test_prompt_logprobs_match_transformers(llama_path: Path, hf_model: PreTrainedModel,
                                            max_num_batched_tokens: int) -> None:
    """16: prompts are chunked, and a step may hold only partial prefills. The shared prompt is cached first, so a
    prefix-cache hit would skip positions."""
    llm = LLM(model=str(llama_path), max_model_len=256, block_size=16, max_num_seqs=4,
              max_num_batched_tokens=max_num_batched_tokens)
    prompts = make_prompts([1, 7, 40, 70], seed=1)
    generate(llm, prompts[2:], SamplingParams(temperature=0.0, max_tokens=2))
    outputs = generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=NUM_LOGPROBS))
    assert llm.llm_engine.engine_core.scheduler.prefix_cache_hits == 0
    for prompt, output in zip(prompts, outputs):
        assert output.prompt_logprobs is not None and len(output.prompt_logprobs) == len(prompt)
        assert output.prompt_logprobs[0] is None
        reference = hf_logprobs(hf_model, prompt)
        for i in range(1, len(prompt)):
            position_logprobs = output.prompt_logprobs[i]
            assert position_logprobs is not None
            assert_top_logprobs(position_logprobs, reference[i - 1], prompt[i], NUM_LOGPROBS)
    llm.shutdown()


def test_parallel_sampling(llm: LLM) -> None:
    prompt = make_prompts([40], seed=2)
    scheduler = llm.llm_engine.engine_core.scheduler
    hits_before = scheduler.prefix_cache_hits
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    [first] = generate(llm, prompt, params)
    # The two later samples reuse the first one's two full prompt blocks, computed in the same step.
    assert scheduler.prefix_cache_hits - hits_before == 2 * 32 and first.num_cached_tokens == 32
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == 40
    samples = [c.token_ids for c in first.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2] and all(len(s) == 12 for s in samples)
    assert len({tuple(s) for s in samples}) == 3
    [again] = generate(llm, prompt, params)
    assert [c.token_ids for c in again.outputs] == samples
    [other_seed] = generate(llm, prompt, SamplingParams(n=3, temperature=1.0, seed=8, max_tokens=12, ignore_eos=True))
    assert [c.token_ids for c in other_seed.outputs] != samples
    [single] = generate(llm, prompt, SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True))
    assert single.outputs[0].token_ids == samples[0]  # sample i uses seed + i


def test_logit_bias_forces_a_token(llm: LLM) -> None:
    prompts = make_prompts([10, 30], seed=3)
    plain = generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    forced = 300
    assert any(forced not in o.outputs[0].token_ids for o in plain)
    for params in (SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={forced: 100.0}),
                   SamplingParams(temperature=1.0, seed=0, max_tokens=6, ignore_eos=True, logit_bias={forced: 100.0})):
        assert all(o.outputs[0].token_ids == [forced] * 6 for o in generate(llm, prompts, params))


def test_min_tokens_holds_back_eos(llm: LLM) -> None:
    eos = llm.get_tokenizer().eos_token_id
    prompts = make_prompts([12], seed=4)
    eager = SamplingParams(temperature=0.0, max_tokens=10, logit_bias={eos: 100.0})
    [output] = generate(llm, prompts, eager)
    assert output.outputs[0].token_ids == [eos] and output.outputs[0].finish_reason == "stop"
    [output] = generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=10, logit_bias={eos: 100.0},
                                                     min_tokens=5))
    tokens = output.outputs[0].token_ids
    assert len(tokens) == 6 and tokens[-1] == eos and eos not in tokens[:5]
    assert output.outputs[0].finish_reason == "stop"


def test_repetition_penalty_avoids_repeats(llm: LLM) -> None:
    prompts = make_prompts([8, 25], seed=5)
    plain = generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert all(len(set(o.outputs[0].token_ids)) < 24 for o in plain)  # the random model loops
    penalized = generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                      repetition_penalty=1e4))
    for prompt, output in zip(prompts, penalized):
        tokens = output.outputs[0].token_ids
        assert len(set(tokens)) == 24 and not set(tokens) & set(prompt)


def reference_penalized_greedy(model: PreTrainedModel, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy decoding on transformers' logits with the penalties applied by their definitions."""
    output: list[int] = []
    for _ in range(params.max_tokens or 0):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output])).logits[0, -1].float()
        for token_id in set(prompt) | set(output):
            value = logits[token_id]
            logits[token_id] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
        for token_id in set(output):
            logits[token_id] -= params.frequency_penalty * output.count(token_id) + params.presence_penalty
        output.append(int(logits.argmax()))
    return output


def test_penalties_match_their_definition(llm: LLM, hf_model: PreTrainedModel) -> None:
    prompts = make_prompts([6, 19], seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3,
                            frequency_penalty=0.6, presence_penalty=0.4)
    plain = generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    penalized = generate(llm, prompts, params)
    for prompt, before, after in zip(prompts, plain, penalized):
        assert after.outputs[0].token_ids != before.outputs[0].token_ids
        assert after.outputs[0].token_ids == reference_penalized_greedy(hf_model, prompt, params)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(llm: LLM, include: bool) -> None:
    """The one-token word " together" is forced; the stop string starts inside one and ends inside the next."""
    tokenizer = llm.get_tokenizer()
    [word] = tokenizer.encode(" together", add_special_tokens=False)
    prompts = make_prompts([9], seed=7)
    base = dict(temperature=0.0, max_tokens=8, ignore_eos=True, logit_bias={word: 100.0})
    [full] = generate(llm, prompts, SamplingParams(**base))
    assert full.outputs[0].text == " together" * 8
    stop = "her tog"
    [output] = generate(llm, prompts, SamplingParams(**base, stop=stop, include_stop_str_in_output=include))
    completion = output.outputs[0]
    end = full.outputs[0].text.index(stop) + (len(stop) if include else 0)
    assert completion.text == full.outputs[0].text[:end]
    assert completion.token_ids == [word, word]  # the second token completes the stop string
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
