"""The sampler against direct reference computations: greedy, seeded Gumbel-max sampling, filters, processors,
logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from raylm.common.sampling_params import SamplingParams
from raylm.runner.penalties import apply_logits_processors
from raylm.runner.sampler import (
    LogprobsTensors,
    Sampler,
    apply_top_k_top_p_min_p,
    argmax_rows,
    lowbias32_,
    random_uniform,
)
from raylm.runner.sampling_metadata import SamplingMetadata, make_padded_token_ids

EOS = 2


@pytest.fixture(autouse=True)
def _seed_torch() -> None:
    torch.manual_seed(0)


def make_metadata(params: list[SamplingParams], vocab_size: int, prompts: list[list[int]] | None = None,
                  outputs: list[list[int]] | None = None, positions: list[int] | None = None) -> SamplingMetadata:
    """What a ModelRunner would build for these requests (prompts/outputs default to empty)."""
    prompts = prompts or [[] for _ in params]
    outputs = outputs or [[] for _ in params]
    positions = positions if positions is not None else [len(out) for out in outputs]
    greedy = [p.greedy for p in params]
    no_penalties = all(p.presence_penalty == 0 and p.frequency_penalty == 0 and p.repetition_penalty == 1
                       for p in params)
    return SamplingMetadata(
        temperature=torch.tensor([0.0 if p.greedy else p.temperature for p in params]),
        all_greedy=all(greedy), all_random=not any(greedy),
        top_k=torch.tensor([p.top_k for p in params]) if any(p.top_k for p in params) else None,
        top_p=torch.tensor([p.top_p for p in params]) if any(p.top_p < 1 for p in params) else None,
        min_p=torch.tensor([p.min_p for p in params]) if any(p.min_p > 0 for p in params) else None,
        seeds=torch.tensor([p.seed for p in params]),
        output_positions=torch.tensor(positions),
        max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=None),
        no_penalties=no_penalties,
        presence_penalties=torch.tensor([p.presence_penalty for p in params]),
        frequency_penalties=torch.tensor([p.frequency_penalty for p in params]),
        repetition_penalties=torch.tensor([p.repetition_penalty for p in params]),
        prompt_token_ids=None if no_penalties else make_padded_token_ids(prompts, vocab_size),
        output_token_ids=None if no_penalties else make_padded_token_ids(outputs, vocab_size),
        min_tokens={row: (p.min_tokens, {EOS, *p.stop_token_ids}) for row, p in enumerate(params) if p.min_tokens},
        logit_bias={row: p.logit_bias for row, p in enumerate(params) if p.logit_bias},
    )


def sample(logits: torch.Tensor, params: list[SamplingParams], **kwargs: list) -> torch.Tensor:
    return Sampler()(logits.clone(), make_metadata(params, logits.shape[-1], **kwargs)).sampled_token_ids


def python_lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_lowbias32_matches_python_reference_and_uniforms_are_reproducible() -> None:
    values = [0, 1, 2**31 - 1, 2**31, 2**32 - 1] + torch.randint(0, 2**32, (1000,), generator=torch.Generator()
                                                                 .manual_seed(0)).tolist()
    assert lowbias32_(torch.tensor(values)).tolist() == [python_lowbias32(v) for v in values]

    seeds, positions = torch.tensor([0, -1, 2**62 + 12345, 7]), torch.tensor([0, 5, 2**31, 7])
    u = random_uniform(seeds, positions, 1000)
    assert torch.equal(u, random_uniform(seeds, positions, 1000))
    assert 0 < u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01
    seed, position, token = 2**62 + 12345, 2**31, 321
    key = python_lowbias32(python_lowbias32(python_lowbias32(seed & 0xFFFFFFFF) ^ (seed >> 32)) ^ position)
    assert u[2, token].item() == ((python_lowbias32(key ^ token) >> 9) + 0.5) / 2**23


def test_greedy_equals_argmax() -> None:
    logits = torch.randn(6, 100)
    assert torch.equal(sample(logits, [SamplingParams(temperature=0.0, seed=i) for i in range(6)]),
                       logits.argmax(dim=-1))
    mixed = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i) for i in range(6)]
    assert torch.equal(sample(logits, mixed)[1::2], logits.argmax(dim=-1)[1::2])


def run_positions(row_params: SamplingParams, others: list[SamplingParams], num_positions: int) -> list[int]:
    """The row's tokens over positions 0..num_positions-1, sampled with `others` placed around it in the batch."""
    vocab_size, tokens = 64, []
    for position in range(num_positions):
        logits = torch.randn(len(others) + 1, vocab_size, generator=torch.Generator().manual_seed(position))
        row = len(others) // 2
        logits[row] = torch.randn(vocab_size, generator=torch.Generator().manual_seed(1000 + position))
        params = others[:row] + [row_params] + others[row:]
        positions = [position if i == row else 3 * i for i in range(len(params))]
        tokens.append(sample(logits, params, positions=positions)[row].item())
    return tokens


@pytest.mark.parametrize("row_params", [SamplingParams(temperature=0.8, seed=1234),
                                        SamplingParams(temperature=1.3, top_k=20, top_p=0.9, min_p=0.02, seed=99)])
def test_seeded_sampling_repeats_and_ignores_the_rest_of_the_batch(row_params: SamplingParams) -> None:
    others = [SamplingParams(temperature=0.0, seed=1), SamplingParams(temperature=0.5, top_k=5, seed=2),
              SamplingParams(temperature=1.0, top_p=0.5, seed=3), SamplingParams(temperature=2.0, min_p=0.1, seed=4)]
    alone = run_positions(row_params, [], 20)
    assert alone == run_positions(row_params, [], 20)
    assert alone == run_positions(row_params, others, 20)
    assert len(set(alone)) > 5  # actually random


def test_different_seeds_differ() -> None:
    first = run_positions(SamplingParams(temperature=1.0, seed=1), [], 20)
    assert first != run_positions(SamplingParams(temperature=1.0, seed=2), [], 20)


@pytest.mark.parametrize("vary", ["seed", "position"])
def test_empirical_distribution_matches_softmax(vary: str) -> None:
    num_draws, temperature = 20_000, 0.7
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -2.0])
    seeds = list(range(num_draws)) if vary == "seed" else [42] * num_draws
    positions = [0] * num_draws if vary == "seed" else list(range(num_draws))
    params = [SamplingParams(temperature=temperature, seed=seed) for seed in seeds]
    tokens = sample(logits.expand(num_draws, -1), params, positions=positions)
    freqs = torch.bincount(tokens, minlength=5).double() / num_draws
    expected = torch.softmax(logits.double() / temperature, dim=-1)
    sigma = (expected * (1 - expected) / num_draws).sqrt()
    assert ((freqs - expected).abs() < 5 * sigma + 1e-4).all(), (freqs, expected)


def test_top_k_one_equals_greedy() -> None:
    logits = torch.randn(8, 100)
    params = [SamplingParams(temperature=1.5, top_k=1, seed=i) for i in range(8)]
    assert torch.equal(sample(logits, params), logits.argmax(dim=-1))


def kept(logits: torch.Tensor, top_k: list[int] | None = None, top_p: list[float] | None = None,
         min_p: list[float] | None = None) -> list[set[int]]:
    """Token ids each filter combination leaves finite, per row."""
    def as_tensor(values: list | None) -> torch.Tensor | None:
        return None if values is None else torch.tensor(values)

    masked = apply_top_k_top_p_min_p(logits.clone(), as_tensor(top_k), as_tensor(top_p), as_tensor(min_p))
    return [set(torch.nonzero(row.isfinite()).flatten().tolist()) for row in masked]


def test_top_k_keeps_exactly_the_k_most_likely() -> None:
    logits = torch.randn(4, 50)
    top_k = [3, 0, 50, 7]
    expected = [set(row.topk(k or 50).indices.tolist()) for row, k in zip(logits, top_k, strict=True)]
    assert kept(logits, top_k=top_k) == expected
    assert kept(logits, top_k=top_k, top_p=[1.0] * 4) == expected  # the sorting path agrees
    params = [SamplingParams(temperature=5.0, top_k=3, seed=i) for i in range(200)]
    assert set(sample(logits[0].expand(200, -1), params).tolist()) == expected[0]


# Probabilities 0.5, 0.25, 0.15, 0.07, 0.03 in shuffled token order.
PROBS = torch.tensor([0.07, 0.5, 0.03, 0.15, 0.25])
HAND_LOGITS = PROBS.log()[None].expand(2, -1)


@pytest.mark.parametrize(("top_p", "expected"), [(0.45, {1}), (0.7, {1, 4}), (0.8, {1, 4, 3}), (0.95, {1, 4, 3, 0}),
                                                 (1.0, {0, 1, 2, 3, 4})])
def test_top_p_keeps_the_smallest_set_with_enough_mass(top_p: float, expected: set[int]) -> None:
    assert kept(HAND_LOGITS, top_p=[top_p, 1.0]) == [expected, {0, 1, 2, 3, 4}]


def test_top_p_applies_to_the_top_k_survivors() -> None:
    # Top-2 renormalised is 2/3, 1/3: p = 0.6 keeps only the first (0.6 of the full distribution would keep two).
    assert kept(HAND_LOGITS, top_k=[2, 0], top_p=[0.6, 0.6]) == [{1}, {1, 4}]


def test_top_p_partial_and_full_sort_agree() -> None:
    logits = torch.randn(6, 200) * 2
    top_k, top_p = [5, 40, 150, 1, 17, 90], [0.5, 0.9, 0.95, 0.3, 1.0, 0.8]
    partial = kept(logits, top_k=top_k, top_p=top_p)  # every row has a top-k: partial sort
    full = kept(torch.cat([logits, logits[:1]]), top_k=top_k + [0], top_p=top_p + [0.9])  # one row without: full sort
    assert partial == full[:6]
    assert all(len(row) <= k for row, k in zip(partial, top_k, strict=True))


def test_min_p_masks_tokens_below_min_p_times_the_top_probability() -> None:
    assert kept(HAND_LOGITS, min_p=[0.2, 0.0]) == [{1, 4, 3}, {0, 1, 2, 3, 4}]
    assert kept(HAND_LOGITS / 0.5, min_p=[0.2, 0.5]) == [{1, 4}, {1}]  # on the tempered probabilities


def reference_processed_logits(logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]],
                               outputs: list[list[int]]) -> torch.Tensor:
    expected = logits.double().clone()
    for row, (p, prompt, output) in enumerate(zip(params, prompts, outputs, strict=True)):
        values = expected[row].tolist()
        for token, bias in (p.logit_bias or {}).items():
            values[token] += bias
        if len(output) < p.min_tokens:
            for token in {EOS, *p.stop_token_ids}:
                values[token] = -math.inf
        for token in set(prompt) | set(output):
            values[token] = values[token] / p.repetition_penalty if values[token] > 0 else \
                values[token] * p.repetition_penalty
        for token in set(output):
            values[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
        expected[row] = torch.tensor(values)
    return expected.float()


def test_logits_processors_match_a_direct_computation() -> None:
    vocab_size = 12
    params = [SamplingParams(repetition_penalty=1.5, seed=0),
              SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4, seed=1),
              SamplingParams(min_tokens=3, stop_token_ids=[5, 7], logit_bias={0: 3.0, 9: -1.5}, seed=2),
              SamplingParams(min_tokens=2, repetition_penalty=0.8, frequency_penalty=-1.0, presence_penalty=2.0,
                             logit_bias={11: 0.25}, seed=3),
              SamplingParams(seed=4), SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, seed=5)]
    prompts = [[1, 3, 3, 8], [4, 4], [6], [0, 1, 10, 11], [], []]
    outputs = [[3, 9, 9], [4, 6, 6, 6, 11], [7, 7], [10, 10, 5], [1, 2], []]  # row 3 has reached min_tokens
    logits = torch.randn(6, vocab_size) * 3
    metadata = make_metadata(params, vocab_size, prompts, outputs)
    processed = apply_logits_processors(logits.clone(), metadata)
    torch.testing.assert_close(processed, reference_processed_logits(logits, params, prompts, outputs))
    assert processed[2, EOS] == processed[2, 5] == processed[2, 7] == -math.inf and processed[3, EOS].isfinite()


def test_random_penalties_match_a_direct_computation() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab_size, num_rows = 30, 16

    def draw(low: float, high: float) -> float:
        return low + (high - low) * torch.rand((), generator=gen).item()

    def token_ids(max_len: int) -> list[int]:
        length = int(torch.randint(0, max_len, (), generator=gen).item())
        return torch.randint(0, vocab_size, (length,), generator=gen).tolist()

    params = [SamplingParams(presence_penalty=draw(-2, 2), frequency_penalty=draw(-2, 2),
                             repetition_penalty=draw(0.5, 2), seed=row) for row in range(num_rows)]
    prompts, outputs = [token_ids(12) for _ in params], [token_ids(20) for _ in params]
    logits = torch.randn(num_rows, vocab_size, generator=gen) * 4
    processed = apply_logits_processors(logits.clone(), make_metadata(params, vocab_size, prompts, outputs))
    torch.testing.assert_close(processed, reference_processed_logits(logits, params, prompts, outputs))


def test_penalties_steer_greedy_rows() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.9, -1.0]])
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.2, seed=0)]
    assert sample(logits, params, outputs=[[1]]).item() == 2
    assert sample(logits, [SamplingParams(temperature=0.0, logit_bias={3: 5.0}, seed=0)]).item() == 3


def test_logprobs_of_the_raw_logits() -> None:
    vocab_size = 50
    logits = torch.randn(3, vocab_size)
    params = [SamplingParams(temperature=1.0, logprobs=2, repetition_penalty=1.3, seed=0),
              SamplingParams(temperature=0.0, seed=1),
              SamplingParams(temperature=0.7, logprobs=4, logit_bias={7: 4.0}, seed=2)]
    output = Sampler()(logits.clone(), make_metadata(params, vocab_size, outputs=[[1, 2], [], [3]]))
    tensors = output.logprobs_tensors
    assert isinstance(tensors, LogprobsTensors) and tensors.token_ids.shape == (3, 5)
    expected = torch.log_softmax(logits, dim=-1)
    sampled = output.sampled_token_ids
    assert torch.equal(tensors.token_ids[:, 0], sampled)
    torch.testing.assert_close(tensors.logprobs[:, 0], expected.gather(1, sampled[:, None])[:, 0], atol=1e-6, rtol=0)
    top = expected.topk(4, dim=-1)
    assert torch.equal(tensors.token_ids[:, 1:], top.indices)
    torch.testing.assert_close(tensors.logprobs[:, 1:], top.values, atol=1e-6, rtol=0)
    for row, token in enumerate(sampled.tolist()):
        assert tensors.ranks[row].item() == 1 + int((expected[row] > expected[row, token]).sum())

    lists = tensors.tolists([2, None, 4])
    assert lists[1] is None and lists[0] is not None and lists[2] is not None
    assert lists[0].token_ids == [tensors.token_ids[0, :3].tolist()] and len(lists[0].logprobs[0]) == 3
    assert lists[2].token_ids == [tensors.token_ids[2].tolist()] and lists[2].ranks == [tensors.ranks[2].item()]


def test_no_logprobs_requested() -> None:
    output = Sampler()(torch.randn(2, 10), make_metadata([SamplingParams(seed=0), SamplingParams(seed=1)], 10))
    assert output.logprobs_tensors is None and output.sampled_token_ids.shape == (2,)


def test_make_padded_token_ids() -> None:
    assert make_padded_token_ids([[1, 2, 3], [], [4]], 9).tolist() == [[1, 2, 3], [9, 9, 9], [4, 9, 9]]
    assert make_padded_token_ids([[], []], 9).shape == (2, 0)


def test_argmax_rows_is_torchs_argmax_with_first_index_on_ties() -> None:
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(0))
    logits[3, [7, 500, 999]] = 100.0  # a three-way tie: the first index wins, as in torch.argmax
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
    assert argmax_rows(logits)[3] == 7 and argmax_rows(logits).dtype == torch.int64
