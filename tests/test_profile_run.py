"""The profile run (runner/profile_run.py) measures what really runs: the configured attention backend on the
heaviest batch a step can hold, then the sampler on a full batch of logits on its heaviest path."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from raylm.runner.attention.common import CommonAttentionMetadata
from raylm.runner.model_runner import ModelRunner
from raylm.runner.profile_run import PROFILE_NUM_LOGPROBS
from raylm.runner.sampler import SamplerOutput
from raylm.runner.sampling_metadata import SamplingMetadata
from tests.runner_steps import model_parallel_of_one, resolved_config  # noqa: F401  (a fixture)


def profiled(llama_path: Path, **settings: Any) -> tuple[ModelRunner, list[CommonAttentionMetadata],
                                                         list[tuple[torch.Size, SamplingMetadata, SamplerOutput]]]:
    runner = ModelRunner(resolved_config(model=str(llama_path), **settings), torch.device("cpu"))
    runner.load_model()
    batches: list[CommonAttentionMetadata] = []
    samples: list[tuple[torch.Size, SamplingMetadata, SamplerOutput]] = []
    build, sample = runner.attn_backend.build, runner.sampler.forward

    def recording_build(common: CommonAttentionMetadata) -> Any:
        batches.append(common)
        return build(common)

    def recording_sample(logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        shape = logits.shape
        output = sample(logits, metadata)
        samples.append((shape, metadata, output))
        return output

    runner.attn_backend.build = recording_build  # type: ignore[method-assign]
    runner.sampler.forward = recording_sample  # type: ignore[method-assign]
    runner.profile_run()
    return runner, batches, samples


@pytest.mark.usefixtures("model_parallel_of_one")
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_the_attention_backend_runs_the_heaviest_batch(llama_path: Path, backend: str) -> None:
    runner, batches, _ = profiled(llama_path, attention_backend=backend, max_num_batched_tokens=200,
                                  max_model_len=96, max_num_seqs=8, block_size=16)
    [common] = batches
    # 200 tokens in queries of at most max_model_len, each at the end of a max_model_len context, writing nothing.
    assert common.num_reqs == 3 and common.num_actual_tokens == 200
    assert common.query_start_loc_cpu.tolist() == [0, 96, 192, 200]
    assert common.seq_lens_cpu.tolist() == [96, 96, 96]
    assert bool((common.slot_mapping == -1).all())
    assert runner.buffers.positions.np[95] == 95 and runner.buffers.positions.np[192] == 88
    assert common.block_table.shape == (3, 6) and common.block_table[2].tolist() == list(range(6))
    assert all(layer.kv_cache.numel() == 0 for layer in runner.attention_layers())


@pytest.mark.usefixtures("model_parallel_of_one")
def test_requests_are_capped_by_max_num_seqs(llama_path: Path) -> None:
    _, batches, _ = profiled(llama_path, max_num_batched_tokens=512, max_model_len=64, max_num_seqs=4)
    [common] = batches
    assert common.num_reqs == 4 and common.num_actual_tokens == 256


@pytest.mark.usefixtures("model_parallel_of_one")
def test_the_sampler_takes_a_full_batch_on_its_heaviest_path(llama_path: Path) -> None:
    runner, _, samples = profiled(llama_path, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)
    [(shape, metadata, output)] = samples
    assert shape == (8, runner.model_info.vocab_size)
    assert metadata.all_random and metadata.top_k is not None and metadata.top_p is not None
    assert not metadata.no_penalties and metadata.max_num_logprobs == PROFILE_NUM_LOGPROBS
    assert output.logprobs_tensors is not None and output.logprobs_tensors.token_ids.shape == (8, 21)
