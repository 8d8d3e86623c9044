"""Padding never touches a real KV slot: both attention backends skip slot -1 when writing K/V, the fixed-buffer
decode path (what a CUDA graph replays) sends padding to the scratch block only, and a ModelRunner whose batches are
all padded (capture sizes that never match, on CPU) writes exactly the slots of its real tokens and samples the same
tokens and logits as the unpadded runner."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from raylm.runner.attention import CPUAttentionBackend, TorchAttentionBackend
from raylm.runner.attention.backend import AttentionBackend
from raylm.runner.attention.common import DecodeGraphBuffers
from raylm.runner.model_runner import ModelRunner
from tests.runner_steps import Steps, make_runner, model_parallel_of_one, run_step
from tests.test_attention_torch import make_common_metadata

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 16, 16, 12


def backends() -> list[Any]:
    cpu = pytest.param(CPUAttentionBackend, marks=pytest.mark.skipif(not CPUAttentionBackend.is_available(),
                                                                     reason="raylm's CPU kernels are not built here"))
    return [TorchAttentionBackend, cpu]


def written_slots(backend: AttentionBackend, before: torch.Tensor, after: torch.Tensor) -> set[int]:
    """Cache slots (block * block_size + offset) whose K or V changed."""
    changed = before != after
    if isinstance(backend, CPUAttentionBackend):  # key tiles are [head_size, block_size], value tiles row-major
        num_blocks, kv_heads, block_size, head_size = changed.shape[1:]
        keys = changed[0].view(num_blocks, kv_heads, head_size, block_size).any(dim=(1, 2))
        per_slot = keys | changed[1].any(dim=(1, 3))
    else:  # [2, num_blocks, block_size, kv_heads, head_size]
        per_slot = changed.any(dim=0).any(dim=(2, 3))
    return set(per_slot.flatten().nonzero().flatten().tolist())


@pytest.mark.parametrize("backend_cls", backends())
def test_backends_write_no_kv_for_slot_minus_one(backend_cls: type[AttentionBackend]) -> None:
    generator = torch.Generator().manual_seed(0)
    backend = backend_cls()
    query_lens, seq_lens, tables = [3, 1, 5], [3, 9, 20], [[4], [7], [2, 9]]
    common, _ = make_common_metadata(query_lens, seq_lens, tables, BLOCK_SIZE, num_padding_tokens=3)
    # Two real rows marked as padding too: a -1 anywhere writes nothing.
    common.slot_mapping[[1, 4]] = -1
    kv_cache = torch.randn(backend.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE),
                           generator=generator)
    before = kv_cache.clone()
    num_tokens = sum(query_lens) + 3
    query = torch.randn(num_tokens, HEADS, HEAD_SIZE, generator=generator)
    key, value = (torch.randn(num_tokens, KV_HEADS, HEAD_SIZE, generator=generator) for _ in range(2))
    output = backend.forward(query, key, value, kv_cache, backend.build(common), HEAD_SIZE**-0.5)
    real = common.slot_mapping[:common.num_actual_tokens]
    assert written_slots(backend, before, kv_cache) == set(real[real >= 0].tolist())
    assert not output[sum(query_lens):].any()  # padding rows: zero


def test_fixed_buffer_decode_writes_padding_to_the_scratch_block_only() -> None:
    """The metadata a captured graph reads: 4 decodes padded to 6 requests equal the regular decode path."""
    generator = torch.Generator().manual_seed(1)
    backend = TorchAttentionBackend()
    seq_lens, tables = [5, 17, 1, 30], [[0, 3], [1, 5], [2], [4, 6]]
    common, _ = make_common_metadata([1] * 4, seq_lens, tables, BLOCK_SIZE)
    kv_cache = torch.randn(backend.get_kv_cache_shape(NUM_BLOCKS + 1, BLOCK_SIZE, KV_HEADS, HEAD_SIZE),
                           generator=generator)
    query = torch.randn(6, HEADS, HEAD_SIZE, generator=generator)
    key, value = (torch.randn(6, KV_HEADS, HEAD_SIZE, generator=generator) for _ in range(2))
    expected_cache = kv_cache.clone()
    expected = backend.forward(query[:4], key[:4], value[:4], expected_cache, backend.build(common),
                               HEAD_SIZE**-0.5)

    scratch = NUM_BLOCKS * BLOCK_SIZE
    slot_mapping = torch.cat([common.slot_mapping, torch.tensor([-1, -1])])
    graph_seq_lens = torch.tensor([*seq_lens, 0, 0], dtype=torch.int32)
    # Stale rows past the batch (any valid block id) are masked by seq_len 0.
    block_table = torch.tensor([[0, 3], [1, 5], [2, 0], [4, 6], [9, 9], [8, 1]], dtype=torch.int32)
    metadata = backend.build_decode_graph(DecodeGraphBuffers(slot_mapping, graph_seq_lens,
                                                             torch.arange(7, dtype=torch.int32), block_table, scratch))
    before = kv_cache.clone()
    output = backend.forward(query, key, value, kv_cache, metadata, HEAD_SIZE**-0.5)
    torch.testing.assert_close(output[:4], expected, atol=1e-5, rtol=1e-5)
    assert output.isfinite().all()
    assert written_slots(backend, before, kv_cache) == {*common.slot_mapping.tolist(), scratch}
    torch.testing.assert_close(kv_cache[:, :NUM_BLOCKS], expected_cache[:, :NUM_BLOCKS])


def serve(runner: ModelRunner) -> tuple[list[dict[str, list[int]]], list[torch.Tensor]]:
    """Two prompts, four decode steps, a third prompt beside a decode: each step writes K/V to exactly the slots of
    its real tokens (and, on the fixed-buffer path, to the scratch slot past the scheduler's blocks)."""
    generator = torch.Generator().manual_seed(2)
    for cache in runner.kv_caches:  # no stale value may equal a new one (a zero embedding gives zero K/V)
        cache.copy_(torch.randn(cache.shape, generator=generator))
    steps = Steps(runner.block_size)
    schedule = [({"a": [5, 17, 33, 2, 101, 64, 7], "b": [9, 8, 7]}, None)] + [(None, {"a": 1, "b": 1})] * 4
    schedule.append(({"c": [40, 41, 42, 43, 44]}, {"a": 1}))
    tokens, logits = [], []
    for prompts, decodes in schedule:
        out = steps.schedule(prompts, decodes)
        before = [cache.clone() for cache in runner.kv_caches]
        sampled, step_logits = run_step(runner, out)
        tokens.append(sampled)
        logits.append(step_logits)
        real = set(runner.buffers.slot_mapping.np[:out.total_num_scheduled_tokens].tolist())
        for old, new in zip(before, runner.kv_caches):
            assert written_slots(runner.attn_backend, old, new) - {runner.graphs.scratch_slot} == real
    return tokens, logits


@pytest.mark.usefixtures(model_parallel_of_one.__name__)
@pytest.mark.parametrize("attention_backend, block_size", [("torch", 4), pytest.param(
    "cpu", 16, marks=pytest.mark.skipif(not CPUAttentionBackend.is_available(), reason="no CPU kernels"))])
def test_padded_runner_samples_the_same(llama_path: Path, attention_backend: str, block_size: int) -> None:
    settings = dict(attention_backend=attention_backend, block_size=block_size)
    expected_tokens, expected_logits = serve(make_runner(llama_path, **settings))
    # 13 never matches a batch here: the decodes of 2 requests are padded to 3 (mixed batches run unpadded).
    runner = make_runner(llama_path, cudagraph_capture_sizes=[3, 13], record_forwards=True, **settings)
    tokens, logits = serve(runner)
    assert runner.forward_log.counts.padded == 4
    assert tokens == expected_tokens
    for ours, reference in zip(logits, expected_logits):
        torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


class EagerGraphs:
    """Stands in for CUDAGraphRunner on CPU: 'replays' by running the captured body, so the runner's replay path
    (fixed buffers, padded seq_lens and slots) runs without CUDA."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.replayed: list[int] = []

    def has(self, num_tokens: int) -> bool:
        return True

    def replay(self, num_tokens: int) -> torch.Tensor:
        self.replayed.append(num_tokens)
        assert self.runner.model is not None and self.runner.graphs is not None
        return self.runner.graphs.forward(self.runner.model, num_tokens)


def check_replay_path_samples_the_same(llama_path: Path, **settings: Any) -> ModelRunner:
    """A runner whose decode batches take the graph replay path (run eagerly) samples the tokens and logits of the
    unpadded runner; returns it."""
    expected_tokens, expected_logits = serve(make_runner(llama_path, **settings))
    runner = make_runner(llama_path, cudagraph_capture_sizes=[4, 8], **settings)
    graphs = EagerGraphs(runner)
    runner.graphs.runner = graphs  # type: ignore[assignment, union-attr]
    tokens, logits = serve(runner)
    assert graphs.replayed == [4, 4, 4, 4]  # the decode steps of 2 requests, padded to 4
    assert tokens == expected_tokens
    for ours, reference in zip(logits, expected_logits):
        torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    return runner


@pytest.mark.usefixtures(model_parallel_of_one.__name__)
def test_fixed_buffer_decode_replay_path_samples_the_same(llama_path: Path) -> None:
    runner = check_replay_path_samples_the_same(llama_path, attention_backend="torch", block_size=4)
    assert runner.graphs.scratch_slot == 32 * 4  # the block past the scheduler's 32


@pytest.mark.usefixtures(model_parallel_of_one.__name__)
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_moe_replay_path_samples_the_same(moe_checkpoints: dict[str, Path], arch: str) -> None:
    """A MoE model's decode graph body (the experts' grouped matmul on device-side row ranges, padding tokens routed
    like any other) samples what the unpadded runner samples."""
    check_replay_path_samples_the_same(moe_checkpoints[arch], attention_backend="torch", block_size=4)
