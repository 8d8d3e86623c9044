"""The flash_attn backend: when it can run (selection and its reasons, on any machine); its own logic (cache writes,
metadata, the fixed-buffer decode a CUDA graph replays) on CPU over a plain-torch stand-in for flash-attn's two calls
(tests/flash_attn_reference.py); and, on CUDA with flash-attn installed, the same output as the torch backend on a mixed
batch of prompts, chunks with context and decodes."""
from __future__ import annotations

import dataclasses
import sys
import types
from pathlib import Path

import pytest
import torch

from raylm.configs.attention_backends import ATTENTION_BACKENDS
from raylm.runner.attention import FlashAttentionBackend, TorchAttentionBackend, choose_attn_backend
from raylm.runner.attention.common import CommonAttentionMetadata
from raylm.runner.attention.flash_attn_backend import unavailable_reason
from tests import flash_attn_reference
from tests.runner_steps import make_runner, model_parallel_of_one
from tests.test_batch_padding import check_replay_path_samples_the_same, serve


def test_reasons_name_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))  # installed, as far as it asks
    cuda = torch.device("cuda")
    assert unavailable_reason(cuda, torch.bfloat16, 256) is None
    assert "CUDA" in unavailable_reason(torch.device("cpu"), torch.bfloat16, 256)
    assert "float16 or bfloat16" in unavailable_reason(cuda, torch.float32, 256)
    assert "multiple of 256 (block_size here: 16)" in unavailable_reason(cuda, torch.bfloat16, 16)
    assert choose_attn_backend("flash_attn", cuda, torch.float16, 512) == FlashAttentionBackend.name
    assert choose_attn_backend("auto", cuda, torch.float16, 16) != FlashAttentionBackend.name


def test_not_installed_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails
    with pytest.raises(ValueError, match=r"flash-attn package does not import.*raylm\[flash\]"):
        choose_attn_backend("flash_attn", "cuda", torch.bfloat16, 256)


@pytest.mark.usefixtures(model_parallel_of_one.__name__)
def test_replay_path_and_eager_steps_sample_as_the_torch_backend(llama_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the stand-in: the decode steps a FULL graph replays (flash_attn_with_kvcache on the persistent buffers,
    padding requests to the scratch slot) and the eager steps (flash_attn_varlen_func) sample what the unpadded
    runner and the torch backend sample, and write exactly the real tokens' slots."""
    monkeypatch.setitem(sys.modules, "flash_attn", flash_attn_reference.as_module())
    # The stand-in runs on CPU, in float32, with blocks of 4: resolution's table says so for this test.
    stand_in = dataclasses.replace(ATTENTION_BACKENDS["flash_attn"], devices=("cpu",), dtypes=("float32",),
                                   block_size_multiple=1)
    monkeypatch.setitem(ATTENTION_BACKENDS, "flash_attn", stand_in)
    flash = check_replay_path_samples_the_same(llama_path, attention_backend="flash_attn", block_size=4)
    assert isinstance(flash.attn_backend, FlashAttentionBackend)
    assert serve(make_runner(llama_path, attention_backend="flash_attn"))[0] == \
        serve(make_runner(llama_path, attention_backend="torch"))[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_matches_torch_backend_on_a_mixed_batch() -> None:
    pytest.importorskip("flash_attn")
    torch.manual_seed(0)
    device, dtype, block_size, heads, kv_heads, head_size = torch.device("cuda"), torch.bfloat16, 256, 8, 2, 64
    context, new = [0, 300, 511, 20], [37, 12, 1, 1]  # a prompt, a chunk with context, two decodes
    seq_lens = [c + n for c, n in zip(context, new)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    block_table = torch.zeros(len(new), max(blocks_per_req), dtype=torch.int32)
    next_block, slots = 1, []
    for r, (c, n) in enumerate(zip(context, new)):
        block_table[r, :blocks_per_req[r]] = torch.arange(next_block, next_block + blocks_per_req[r])
        next_block += blocks_per_req[r]
        slots += [int(block_table[r, p // block_size]) * block_size + p % block_size for p in range(c, c + n)]
    query_start_loc = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc.to(device), query_start_loc, torch.tensor(seq_lens, dtype=torch.int32, device=device),
        torch.tensor(seq_lens, dtype=torch.int32), block_table.to(device), torch.tensor(slots, device=device),
        len(new), sum(new), max(new), max(seq_lens))
    shape = TorchAttentionBackend.get_kv_cache_shape(next_block, block_size, kv_heads, head_size)
    cache = torch.randn(shape, dtype=dtype, device=device)  # the cached context's K/V
    q, k, v = (torch.randn(sum(new), h, head_size, dtype=dtype, device=device) for h in (heads, kv_heads, kv_heads))
    outputs, caches = [], []
    for backend in (FlashAttentionBackend(), TorchAttentionBackend()):
        kv_cache = cache.clone()
        outputs.append(backend.forward(q, k, v, kv_cache, backend.build(common), head_size**-0.5))
        caches.append(kv_cache)
    torch.testing.assert_close(caches[0], caches[1])
    torch.testing.assert_close(outputs[0], outputs[1], atol=2e-2, rtol=2e-2)
