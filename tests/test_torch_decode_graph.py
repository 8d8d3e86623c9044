"""The torch backend's decode inside a CUDA graph: the packed decode (the blocks in use, packed to a fixed capacity)
against the decode it replaced (every request over the whole block-table width, masked: batch x max_model_len keys
per layer), kept here as the reference: the same outputs on random batches, bit-identical on a second run, the same
greedy tokens from a model served through the graph body; a batch past the capacity (requests sharing prefix blocks)
is refused by decode_graph_fits and runs eagerly."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from raylm.runner.attention.common import DecodeGraphBuffers
from raylm.runner.attention.torch_backend import DecodeGraphMetadata, TorchAttentionBackend
from raylm.runner.attention.torch_paged_decode import blocks_attended, decode_capacity, packed_paged_decode
from tests.runner_steps import make_runner, model_parallel_of_one
from tests.test_batch_padding import EagerGraphs, serve

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 8, 2, 16, 4


def old_decode_graph(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                     metadata: DecodeGraphMetadata, scale: float, sliding_window: int | None = None,
                     logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The replaced decode, as it was: K/V gathered over the whole block-table width for every request (no window,
    no soft-cap, no sinks: the Llama model served here has none)."""
    assert sliding_window is None and logits_soft_cap is None and sinks is None
    buffers = metadata.buffers
    block_size = kv_cache.shape[2]
    key_cache, value_cache = kv_cache[0].flatten(0, 1), kv_cache[1].flatten(0, 1)
    slots = torch.where(buffers.slot_mapping >= 0, buffers.slot_mapping, buffers.scratch_slot)
    key_cache.index_copy_(0, slots, key)
    value_cache.index_copy_(0, slots, value)
    num_reqs, num_kv_heads = query.shape[0], key.shape[1]
    key_pos = torch.arange(buffers.block_table.shape[1] * block_size, device=query.device)
    kv_slots = buffers.block_table[:, key_pos // block_size].long() * block_size + key_pos % block_size
    k = key_cache.index_select(0, kv_slots.flatten()).unflatten(0, kv_slots.shape).transpose(1, 2)
    v = value_cache.index_select(0, kv_slots.flatten()).unflatten(0, kv_slots.shape).transpose(1, 2)
    mask = key_pos < buffers.seq_lens.clamp(min=1)[:, None]
    q = query.unflatten(1, (num_kv_heads, -1))
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return o.reshape(num_reqs, -1)


def random_batch(seq_lens: list[int], width: int, num_cache_blocks: int, seed: int,
                 shared_prefix_blocks: int = 0) -> tuple[torch.Tensor, ...]:
    """query, caches, a block table of distinct blocks (the first `shared_prefix_blocks` shared by every request),
    seq_lens."""
    generator = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_cache_blocks, generator=generator).tolist()
    shared = [free.pop() for _ in range(shared_prefix_blocks)]
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for r, s in enumerate(seq_lens):
        needed = -(-max(s, 1) // BLOCK_SIZE)
        row = shared[:needed] + [free.pop() for _ in range(needed - min(needed, len(shared)))]
        table[r, :needed] = torch.tensor(row)
        table[r, needed:] = torch.randint(0, num_cache_blocks, (width - needed,), generator=generator)  # stale
    query = torch.randn(len(seq_lens), HEADS, HEAD_SIZE, generator=generator)
    caches = torch.randn(2, num_cache_blocks, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, generator=generator)
    return query, caches, table, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize("seq_lens", [[1], [5, 17, 1, 30, 0, 0], [4, 8, 12, 16], [33, 2, 64, 9, 1, 3, 70, 11]],
                         ids=["one", "padding_rows", "block_aligned", "mixed"])
def test_packed_decode_matches_the_old_decode(seq_lens: list[int]) -> None:
    width, num_cache_blocks = 20, 80
    query, caches, table, lens = random_batch(seq_lens, width, num_cache_blocks, seed=len(seq_lens))
    capacity = decode_capacity(len(seq_lens), width, num_cache_blocks)
    needed = blocks_attended(lens, BLOCK_SIZE)
    ours = packed_paged_decode(query, caches[0], caches[1], table, lens, HEAD_SIZE**-0.5, capacity)
    torch.testing.assert_close(ours, _old_attention(query, caches, table, lens), atol=1e-5, rtol=1e-5)
    # A capacity of exactly the blocks attended to gives the same bits; a second run too.
    tight = packed_paged_decode(query, caches[0], caches[1], table, lens, HEAD_SIZE**-0.5, needed)
    assert torch.equal(tight, ours)
    assert torch.equal(packed_paged_decode(query, caches[0], caches[1], table, lens, HEAD_SIZE**-0.5, capacity), ours)


def _old_attention(query: torch.Tensor, caches: torch.Tensor, table: torch.Tensor,
                   seq_lens: torch.Tensor) -> torch.Tensor:
    """The old decode's attention over the given caches (no new K/V: its write goes to a scratch copy)."""
    num_reqs = len(seq_lens)
    padded = torch.cat([caches, torch.zeros(2, 1, *caches.shape[2:])], dim=1)  # a scratch block past the cache
    scratch_slot = caches.shape[1] * BLOCK_SIZE
    buffers = DecodeGraphBuffers(torch.full((num_reqs,), -1), seq_lens, torch.arange(num_reqs + 1), table, scratch_slot)
    empty = torch.zeros(num_reqs, KV_HEADS, HEAD_SIZE)
    metadata = DecodeGraphMetadata(TorchAttentionBackend(), num_reqs, buffers)
    return old_decode_graph(query, empty, empty, padded, metadata, HEAD_SIZE**-0.5)


def test_memory_follows_the_blocks_in_use_and_shared_prefixes_run_eagerly() -> None:
    backend = TorchAttentionBackend()
    width, num_cache_blocks = 64, 40  # max_model_len 256 tokens; a cache of 160
    kv_cache = torch.zeros(2, num_cache_blocks, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
    # 8 requests: 8 x 64 = 512 blocks on the full width, at most 40 + 8 packed.
    assert decode_capacity(8, width, num_cache_blocks) == 48
    assert backend.decode_graph_fits(torch.tensor([100, 20, 7]), 8, kv_cache, width)  # 25 + 5 + 2 + 5 padding
    # Six requests over one shared 120-token prefix attend to 6 x 31 blocks: more than the cache holds.
    query, caches, table, lens = random_batch([121] * 6, width, num_cache_blocks, seed=0, shared_prefix_blocks=30)
    assert not backend.decode_graph_fits(lens, 8, kv_cache, width)
    # What the eager path then computes matches the old decode.
    ours = packed_paged_decode(query, caches[0], caches[1], table, lens, HEAD_SIZE**-0.5,
                               blocks_attended(lens, BLOCK_SIZE))
    torch.testing.assert_close(ours, _old_attention(query, caches, table, lens), atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures(model_parallel_of_one.__name__)
def test_served_tokens_equal_the_old_decode(llama_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Token-exact through the model: every decode step through the graph body, new decode against old."""
    results = []
    for decode in (None, old_decode_graph):
        if decode is not None:
            monkeypatch.setattr(TorchAttentionBackend, "_forward_decode_graph", staticmethod(decode))
        runner = make_runner(llama_path, cudagraph_capture_sizes=[4, 8], attention_backend="torch", block_size=4)
        graphs = EagerGraphs(runner)
        runner.graphs.runner = graphs  # type: ignore[assignment, union-attr]
        results.append(serve(runner))
        assert graphs.replayed == [4, 4, 4, 4]
    (new_tokens, new_logits), (old_tokens, old_logits) = results
    assert new_tokens == old_tokens
    for new, old in zip(new_logits, old_logits):
        torch.testing.assert_close(new, old, atol=1e-5, rtol=1e-5)
