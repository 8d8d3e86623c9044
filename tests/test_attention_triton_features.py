"""The triton kernel's sliding window, soft-cap and attention sinks against the torch backend's
(tests/test_attention_sliding.py and tests/test_attention_sinks.py check that one against a naive reference); on CPU
in Triton's interpreter, as tests/test_attention_triton.py sets up."""
from __future__ import annotations

import pytest
import torch

from raylm.runner.attention.torch_backend import TorchAttentionBackend
from tests.test_attention_torch import make_common_metadata
from tests.test_attention_triton import DEVICE, TritonAttentionBackend, _on_device

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 16, 4, 64


@pytest.mark.parametrize(("window", "cap", "with_sinks"), [
    (5, None, False), (None, 0.5, False), (7, 0.5, False), (None, None, True), (5, None, True), (7, 0.5, True)])
def test_matches_torch_backend(window: int | None, cap: float | None, with_sinks: bool) -> None:
    """Decodes (one 70 keys in, whose window starts past the kernel's first two tiles), a prompt, a chunk with
    context; a window, a cap, both, and the same with GPT-OSS's sinks (one logit per head in each denominator)."""
    query_lens, seq_lens = [1, 9, 1, 6], [70, 9, 3, 20]
    generator = torch.Generator().manual_seed(0)
    free = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    tables = [[free.pop() for _ in range(-(-s // BLOCK_SIZE))] for s in seq_lens]
    common = _on_device(make_common_metadata(query_lens, seq_lens, tables, BLOCK_SIZE)[0])
    n = sum(query_lens)
    query = (torch.randn(n, HEADS, HEAD_SIZE, generator=generator) * 2).to(DEVICE)
    key, value = (torch.randn(n, KV_HEADS, HEAD_SIZE, generator=generator).to(DEVICE) for _ in range(2))
    shape = TorchAttentionBackend.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
    kv_cache = torch.randn(shape, generator=generator).to(DEVICE)
    sinks = torch.tensor([-3.0, 0.0, 1.5, 6.0], device=DEVICE) if with_sinks else None
    outputs = [backend.forward(query, key, value, kv_cache.clone(), backend.build(common), HEAD_SIZE**-0.5,
                               sliding_window=window, logits_soft_cap=cap, sinks=sinks)
               for backend in (TritonAttentionBackend(), TorchAttentionBackend())]
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=1e-5)
    # What the case adds changed something: the sinks over the same window and cap, else the window or the cap.
    kept = dict(sliding_window=window, logits_soft_cap=cap) if with_sinks else {}
    without = TorchAttentionBackend().forward(query, key, value, kv_cache.clone(),
                                              TorchAttentionBackend().build(common), HEAD_SIZE**-0.5, **kept)
    assert not torch.allclose(outputs[1], without, atol=1e-3)
