"""Sliding windows and logit soft-capping in the torch backend (every group kind, the decode-graph path and the
cache-less dummy run) against a naive per-request reference."""
from __future__ import annotations

import pytest
import torch
from test_attention_torch import make_common_metadata

from raylm.runner.attention import torch_backend
from raylm.runner.attention.common import DecodeGraphBuffers
from raylm.runner.attention.torch_backend import TorchAttentionBackend
from raylm.runner.attention.torch_paged_decode import decode_capacity
from raylm.runner.forward_context import set_forward_context
from raylm.runner.layers.attention import Attention

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 8, 4, 48
SCALE = HEAD_SIZE**-0.5


def reference(query: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], query_lens: list[int],
              window: int | None, cap: float | None) -> torch.Tensor:
    """Per request in float64: its query rows (the last of its keys) over its keys, causal, within the window."""
    outputs, start = [], 0
    for q_len, k, v in zip(query_lens, keys, values, strict=True):
        s_len = k.shape[0]
        k, v = (t.double().repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,shd->hqs", query[start:start + q_len].double(), k) * SCALE
        if cap is not None:
            scores = torch.tanh(scores / cap) * cap
        key_pos, query_pos = torch.arange(s_len)[None, :], torch.arange(s_len - q_len, s_len)[:, None]
        visible = (key_pos <= query_pos) & (key_pos > query_pos - (window or s_len))
        outputs.append(torch.einsum("hqs,shd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1),
                                    v).flatten(1))
        start += q_len
    return torch.cat(outputs)


def _cache_and_tables(seq_lens: list[int], generator: torch.Generator) -> tuple[torch.Tensor, list[list[int]]]:
    free = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    tables = [[free.pop() for _ in range(-(-s // BLOCK_SIZE))] for s in seq_lens]
    shape = TorchAttentionBackend.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
    return torch.randn(shape, generator=generator), tables


def _cached(kv_cache: torch.Tensor, table: list[int], s_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(s_len)]
    return kv_cache[0].flatten(0, 1)[slots], kv_cache[1].flatten(0, 1)[slots]


@pytest.mark.parametrize("score_chunk", [torch_backend.SCORE_CHUNK, 64])  # 64: a few query rows at a time
@pytest.mark.parametrize(("window", "cap"), [(3, None), (None, 0.5), (5, 0.5)])
@pytest.mark.parametrize(("query_lens", "seq_lens"), [
    ([1, 7, 1, 5, 1], [9, 7, 3, 12, 1]),  # decodes of different lengths, a prefill, a chunk with context
    ([1, 1, 1], [6, 11, 6]),  # decodes only
    ([9, 9], [9, 9]),  # equal prompts: causal, batched
    ([5, 6, 6], [5, 6, 6]),  # prompts of close lengths: padded to the longest
    ([1, 3, 13, 2, 1], [5, 3, 13, 6, 1]),  # prompts of far-apart lengths: packed block-diagonally
])
def test_window_and_cap_match_reference(query_lens: list[int], seq_lens: list[int], window: int | None,
                                        cap: float | None, score_chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_backend, "SCORE_CHUNK", score_chunk)
    generator = torch.Generator().manual_seed(0)
    backend = TorchAttentionBackend()
    kv_cache, tables = _cache_and_tables(seq_lens, generator)
    common, _ = make_common_metadata(query_lens, seq_lens, tables, BLOCK_SIZE)
    n = sum(query_lens)
    query = torch.randn(n, HEADS, HEAD_SIZE, generator=generator) * 3  # sharp enough for the cap to matter
    key, value = (torch.randn(n, KV_HEADS, HEAD_SIZE, generator=generator) for _ in range(2))
    output = backend.forward(query, key, value, kv_cache, backend.build(common), SCALE, sliding_window=window,
                             logits_soft_cap=cap)
    keys, values = zip(*(_cached(kv_cache, t, s) for t, s in zip(tables, seq_lens, strict=True)), strict=True)
    expected = reference(query, list(keys), list(values), query_lens, window, cap)
    torch.testing.assert_close(output.double(), expected, atol=1e-5, rtol=1e-5)
    plain = reference(query, list(keys), list(values), query_lens, None, None)
    assert not torch.allclose(expected, plain, atol=1e-3)  # the window or the cap changed something


def decode_graph_step(generator: torch.Generator
                      ) -> tuple[list[int], torch.Tensor, list[list[int]], DecodeGraphBuffers]:
    """Three decodes (9, 2 and 14 keys) padded to 4 requests in a CUDA graph's fixed buffers, over a random cache:
    (seq_lens, kv_cache, block tables, buffers)."""
    seq_lens = [9, 2, 14]
    kv_cache, tables = _cache_and_tables(seq_lens, generator)
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables] + [[0] * width], dtype=torch.int32)
    common, _ = make_common_metadata([1, 1, 1], seq_lens, tables, BLOCK_SIZE)
    slot_mapping = torch.cat([common.slot_mapping, torch.tensor([-1])])
    buffers = DecodeGraphBuffers(slot_mapping, torch.tensor([*seq_lens, 1], dtype=torch.int32),
                                 torch.arange(5, dtype=torch.int32), block_table,
                                 scratch_slot=NUM_BLOCKS * BLOCK_SIZE - 1)
    assert decode_capacity(4, width, NUM_BLOCKS) > sum(len(t) for t in tables)
    return seq_lens, kv_cache, tables, buffers


@pytest.mark.parametrize(("window", "cap"), [(3, None), (6, 0.5)])
def test_decode_graph_path_matches_reference(window: int, cap: float | None) -> None:
    """The fixed-buffer decode a CUDA graph captures (packed blocks), padded to 4 requests."""
    generator = torch.Generator().manual_seed(1)
    backend = TorchAttentionBackend()
    seq_lens, kv_cache, tables, buffers = decode_graph_step(generator)
    query = torch.randn(4, HEADS, HEAD_SIZE, generator=generator) * 3
    key, value = (torch.randn(4, KV_HEADS, HEAD_SIZE, generator=generator) for _ in range(2))
    output = backend.forward(query, key, value, kv_cache, backend.build_decode_graph(buffers), SCALE,
                             sliding_window=window, logits_soft_cap=cap)
    keys, values = zip(*(_cached(kv_cache, t, s) for t, s in zip(tables, seq_lens, strict=True)), strict=True)
    expected = reference(query[:3], list(keys), list(values), [1, 1, 1], window, cap)
    torch.testing.assert_close(output[:3].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("score_chunk", [torch_backend.SCORE_CHUNK, 64])
def test_dummy_run_applies_window_and_cap(score_chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without metadata (dummy and profile runs) a layer attends over the batch as one sequence, window and cap
    included."""
    monkeypatch.setattr(torch_backend, "SCORE_CHUNK", score_chunk)
    generator = torch.Generator().manual_seed(2)
    layer = Attention(HEADS, HEAD_SIZE, SCALE, KV_HEADS, sliding_window=4, logits_soft_cap=0.5)
    query = torch.randn(10, HEADS * HEAD_SIZE, generator=generator) * 3
    key, value = (torch.randn(10, KV_HEADS * HEAD_SIZE, generator=generator) for _ in range(2))
    with set_forward_context(None, 10):
        output = layer(query, key, value)
    expected = reference(query.unflatten(1, (HEADS, HEAD_SIZE)), [key.unflatten(1, (KV_HEADS, HEAD_SIZE))],
                         [value.unflatten(1, (KV_HEADS, HEAD_SIZE))], [10], 4, 0.5)
    torch.testing.assert_close(output.double(), expected, atol=1e-5, rtol=1e-5)
