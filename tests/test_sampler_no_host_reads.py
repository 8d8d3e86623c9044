"""The sampler's CUDA path reads nothing back to the host: compiled with fullgraph=True and a backend that fails on
any data-dependent value (tests/host_reads.py), it samples every path (greedy, random with top-k / top-p / min-p,
mixed greedy and random, penalties, logit bias, min_tokens, logprobs) exactly as the CPU's eager path does."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from raylm.common.sampling_params import SamplingParams
from raylm.runner.sampler import Sampler, SamplerOutput
from tests.host_reads import HOST_READ, compile_without_host_reads
from tests.test_sampler import make_metadata

VOCAB = 96
G = dict(temperature=0.0, seed=3)
R = dict(temperature=0.8, seed=7)
CASES = {
    "greedy": [SamplingParams(**G)] * 3,
    "random": [SamplingParams(**R), SamplingParams(temperature=1.3, seed=1)],
    "top_k": [SamplingParams(**R, top_k=5), SamplingParams(**R, top_k=0), SamplingParams(**R, top_k=40)],
    "top_p": [SamplingParams(**R, top_p=0.6), SamplingParams(**R, top_p=1.0)],
    "top_k_top_p_min_p": [SamplingParams(**R, top_k=7, top_p=0.9, min_p=0.05), SamplingParams(**R, min_p=0.2)],
    "mixed": [SamplingParams(**G), SamplingParams(**R, top_k=3), SamplingParams(**G), SamplingParams(**R, top_p=0.5)],
    "penalties": [SamplingParams(**G, repetition_penalty=1.3, presence_penalty=0.5),
                  SamplingParams(**R, frequency_penalty=0.7)],
    "logit_bias_min_tokens": [SamplingParams(**G, logit_bias={3: 5.0, 9: -2.0}),
                              SamplingParams(**R, min_tokens=4, stop_token_ids=[11])],
    "logprobs": [SamplingParams(**G, logprobs=5), SamplingParams(**R, top_k=4, logprobs=0)],
}
HISTORY = dict(prompts=[[1, 2, 3, 2], [5, 5], [7], [9, 8]], outputs=[[4, 4], [], [2, 3, 3], [1]])


def cut(history: dict[str, list[list[int]]], n: int) -> dict[str, list[list[int]]]:
    return {key: rows[:n] for key, rows in history.items()}


def assert_same(compiled: SamplerOutput, eager: SamplerOutput) -> None:
    assert torch.equal(compiled.sampled_token_ids, eager.sampled_token_ids)
    assert (compiled.logprobs_tensors is None) == (eager.logprobs_tensors is None)
    if eager.logprobs_tensors is not None:
        assert compiled.logprobs_tensors is not None
        for field in ("token_ids", "logprobs", "ranks"):
            assert torch.equal(getattr(compiled.logprobs_tensors, field), getattr(eager.logprobs_tensors, field))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("host_max_top_k", [False, True], ids=["full_sort", "host_max_top_k"])
def test_sampler_compiles_without_host_reads(case: str, host_max_top_k: bool) -> None:
    params = CASES[case]
    metadata = make_metadata(params, VOCAB, **cut(HISTORY, len(params)))
    if host_max_top_k:  # what SamplingMetadataBuilder sets from the batch's CPU copies
        ks = [p.top_k if 0 < p.top_k <= VOCAB else VOCAB for p in params]
        metadata = dataclasses.replace(metadata, max_top_k=max(ks))
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(3))
    sampler = Sampler()
    compiled, backend = compile_without_host_reads(sampler)
    got = compiled(logits.clone(), metadata)
    assert backend.num_graphs >= 1  # the compiled path ran, not an eager fallback
    assert_same(got, sampler(logits.clone(), metadata))


def test_a_host_read_fails_the_compile() -> None:
    """The check itself: the sampler's old top-k (`int(top_k.max())` on the device tensor) is refused."""
    def old_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
        return logits.topk(int(top_k.max()), dim=-1).values

    compiled, _ = compile_without_host_reads(old_top_k)
    with pytest.raises(Exception, match=HOST_READ):
        compiled(torch.randn(2, VOCAB), torch.tensor([3, 5]))
