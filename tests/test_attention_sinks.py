"""Attention sinks (GPT-OSS: a learned logit per query head that joins each softmax's denominator) in the torch
backend, every group kind, the decode-graph path and the cache-less dummy run, against a naive per-request reference
(tests/test_cpu_kernels.py checks the cpu kernel against this backend, tests/test_attention_triton_features.py the
Triton kernel)."""
from __future__ import annotations

import pytest
import torch
from test_attention_sliding import (
    BLOCK_SIZE,
    HEAD_SIZE,
    HEADS,
    KV_HEADS,
    SCALE,
    _cache_and_tables,
    _cached,
    decode_graph_step,
)
from test_attention_torch import make_common_metadata

from raylm.runner.attention.torch_backend import TorchAttentionBackend
from raylm.runner.forward_context import set_forward_context
from raylm.runner.layers.attention import Attention

SINKS = torch.tensor([-3.0, 0.0, 1.5, 6.0])  # one per query head: from barely felt to most of the weight


def reference(query: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], query_lens: list[int],
              window: int | None, sinks: torch.Tensor) -> torch.Tensor:
    """Per request in float64, as transformers' eager GPT-OSS attention: the sink is one more logit of each row's
    softmax, and its weight is dropped."""
    outputs, start = [], 0
    for q_len, k, v in zip(query_lens, keys, values, strict=True):
        s_len = k.shape[0]
        k, v = (t.double().repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,shd->hqs", query[start:start + q_len].double(), k) * SCALE
        key_pos, query_pos = torch.arange(s_len)[None, :], torch.arange(s_len - q_len, s_len)[:, None]
        visible = (key_pos <= query_pos) & (key_pos > query_pos - (window or s_len))
        logits = torch.cat([scores.masked_fill(~visible, float("-inf")),
                            sinks.double()[:, None, None].expand(-1, q_len, 1)], dim=-1)
        outputs.append(torch.einsum("hqs,shd->qhd", logits.softmax(-1)[..., :-1], v).flatten(1))
        start += q_len
    return torch.cat(outputs)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize(("query_lens", "seq_lens"), [
    ([1, 7, 1, 5, 1], [9, 7, 3, 12, 1]),  # decodes of different lengths, a prefill, a chunk with context
    ([9, 9], [9, 9]),  # equal prompts: causal, batched
    ([1, 3, 13, 2, 1], [5, 3, 13, 6, 1]),  # prompts of far-apart lengths: packed block-diagonally
])
def test_sinks_match_reference(query_lens: list[int], seq_lens: list[int], window: int | None) -> None:
    generator = torch.Generator().manual_seed(0)
    backend = TorchAttentionBackend()
    kv_cache, tables = _cache_and_tables(seq_lens, generator)
    common, _ = make_common_metadata(query_lens, seq_lens, tables, BLOCK_SIZE)
    n = sum(query_lens)
    query = torch.randn(n, HEADS, HEAD_SIZE, generator=generator)
    key, value = (torch.randn(n, KV_HEADS, HEAD_SIZE, generator=generator) for _ in range(2))
    output = backend.forward(query, key, value, kv_cache, backend.build(common), SCALE, sliding_window=window,
                             sinks=SINKS)
    keys, values = zip(*(_cached(kv_cache, t, s) for t, s in zip(tables, seq_lens, strict=True)), strict=True)
    expected = reference(query, list(keys), list(values), query_lens, window, SINKS)
    torch.testing.assert_close(output.double(), expected, atol=1e-5, rtol=1e-5)
    without = reference(query, list(keys), list(values), query_lens, window, torch.full((HEADS,), -torch.inf))
    assert not torch.allclose(expected, without, atol=1e-3)


@pytest.mark.parametrize("window", [None, 6])
def test_decode_graph_path_matches_reference(window: int | None) -> None:
    """The fixed-buffer decode a CUDA graph captures (packed blocks, the request max from a scatter), padded to 4."""
    generator = torch.Generator().manual_seed(1)
    backend = TorchAttentionBackend()
    seq_lens, kv_cache, tables, buffers = decode_graph_step(generator)
    query = torch.randn(4, HEADS, HEAD_SIZE, generator=generator) * 3
    key, value = (torch.randn(4, KV_HEADS, HEAD_SIZE, generator=generator) for _ in range(2))
    output = backend.forward(query, key, value, kv_cache, backend.build_decode_graph(buffers), SCALE,
                             sliding_window=window, sinks=SINKS)
    keys, values = zip(*(_cached(kv_cache, t, s) for t, s in zip(tables, seq_lens, strict=True)), strict=True)
    expected = reference(query[:3], list(keys), list(values), [1, 1, 1], window, SINKS)
    torch.testing.assert_close(output[:3].double(), expected, atol=1e-5, rtol=1e-5)


def test_dummy_run_applies_sinks() -> None:
    """Without metadata (dummy and profile runs) a layer attends over the batch as one sequence, sinks included."""
    generator = torch.Generator().manual_seed(2)
    layer = Attention(HEADS, HEAD_SIZE, SCALE, KV_HEADS, sliding_window=4)
    query = torch.randn(10, HEADS * HEAD_SIZE, generator=generator)
    key, value = (torch.randn(10, KV_HEADS * HEAD_SIZE, generator=generator) for _ in range(2))
    with set_forward_context(None, 10):
        output = layer(query, key, value, sinks=SINKS)
    expected = reference(query.unflatten(1, (HEADS, HEAD_SIZE)), [key.unflatten(1, (KV_HEADS, HEAD_SIZE))],
                         [value.unflatten(1, (KV_HEADS, HEAD_SIZE))], [10], 4, SINKS)
    torch.testing.assert_close(output.double(), expected, atol=1e-5, rtol=1e-5)
