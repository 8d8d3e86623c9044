"""The triton attention backend against the torch backend: its two kernels on tiny batches, then the whole engine
token for token. On CUDA the kernels are compiled; on CPU they run in Triton's interpreter (TRITON_INTERPRET=1)."""
from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from raylm.cluster import LLM, SamplingParams
from raylm.runner.attention import choose_attn_backend
from raylm.runner.attention.common import CommonAttentionMetadata
from raylm.runner.attention.torch_backend import TorchAttentionBackend
from tests.runner_steps import model_parallel_of_one
from tests.test_attention_torch import make_common_metadata
from tests.test_batch_padding import check_replay_path_samples_the_same

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
NUM_BLOCKS = 24

# Triton decides between compiled and interpreted code when `@triton.jit` runs: for its own tl.* helpers when triton
# is imported, for raylm's kernels when triton_kernels is. On CPU both must happen under TRITON_INTERPRET=1.
with pytest.MonkeyPatch.context() as _patch:
    if not ON_CUDA:
        _patch.setenv("TRITON_INTERPRET", "1")
    triton = pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    if not ON_CUDA and not isinstance(triton.language.zeros, InterpretedFunction):
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set; run this file alone or under "
                    "TRITON_INTERPRET=1", allow_module_level=True)
    from raylm.runner.attention import triton_kernels

    if not ON_CUDA and not isinstance(triton_kernels.paged_attention, InterpretedFunction):  # imported earlier
        importlib.reload(triton_kernels)
    from raylm.runner.attention.triton_backend import TritonAttentionBackend


@pytest.fixture(scope="module", autouse=True)
def triton_interpreter() -> Iterator[None]:
    """choose_attn_backend reads TRITON_INTERPRET when called: keep it set on CPU while these tests run."""
    with pytest.MonkeyPatch.context() as patch:
        if not ON_CUDA:
            patch.setenv("TRITON_INTERPRET", "1")
        yield


def _on_device(common: CommonAttentionMetadata) -> CommonAttentionMetadata:
    return dataclasses.replace(common, query_start_loc=common.query_start_loc.to(DEVICE),
                               seq_lens=common.seq_lens.to(DEVICE), block_table=common.block_table.to(DEVICE),
                               slot_mapping=common.slot_mapping.to(DEVICE))


def _compare(query_lens: list[int], seq_lens: list[int], block_size: int = 4, num_heads: int = 4,
             num_kv_heads: int = 2, head_size: int = 16, num_padding_tokens: int = 0,
             dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Both backends on one batch over copies of one random cache; asserts they write the same cache and returns
    (triton output, torch output)."""
    generator = torch.Generator().manual_seed(0)
    free = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    block_tables = [[free.pop() for _ in range(-(-s // block_size))] for s in seq_lens]
    common, _ = make_common_metadata(query_lens, seq_lens, block_tables, block_size, num_padding_tokens)
    # A block table narrower than its buffer, as the runner passes it: rows are not contiguous.
    common = _on_device(common)
    common.block_table = torch.nn.functional.pad(common.block_table, (0, 3))[:, :common.block_table.shape[1]]
    num_tokens, width = sum(query_lens) + num_padding_tokens, (num_heads + 2 * num_kv_heads) * head_size
    # Query, key and value are views of one projection, as in the model.
    qkv = torch.randn(num_tokens, width, generator=generator).to(DEVICE, dtype)
    query, key, value = qkv.split([num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], 1)
    query, key, value = (t.unflatten(1, (-1, head_size)) for t in (query, key, value))
    shape = TorchAttentionBackend.get_kv_cache_shape(NUM_BLOCKS, block_size, num_kv_heads, head_size)
    kv_cache = torch.randn(shape, generator=generator).to(DEVICE, dtype)  # stands in for the context of earlier steps
    outputs, caches = [], []
    for backend in (TritonAttentionBackend(), TorchAttentionBackend()):
        cache = kv_cache.clone()
        outputs.append(backend.forward(query, key, value, cache, backend.build(common), head_size**-0.5))
        caches.append(cache)
    assert torch.equal(caches[0], caches[1])
    assert outputs[0].shape == (num_tokens, num_heads * head_size)
    return outputs[0], outputs[1]


@pytest.mark.parametrize(("query_lens", "seq_lens", "block_size"), [
    ([5, 9], [5, 9], 4),  # prompts only
    ([1, 1, 1], [16, 3, 37], 4),  # decodes only: a new key that ends a block, one that starts a block
    ([1, 6, 1, 3], [9, 6, 1, 11], 4),  # mixed: decodes, a prompt, a chunk with context
    ([4, 16], [20, 16], 4),  # chunked prefill with context; a prompt of 4 blocks exactly
    ([7, 1], [23, 17], 16),  # block size 16: a chunk across a block boundary, a decode one past it
    ([40], [40], 4),  # more queries than one program takes (32 with 2 heads per KV head), over 10 blocks
])
def test_matches_torch_backend(query_lens: list[int], seq_lens: list[int], block_size: int) -> None:
    ours, expected = _compare(query_lens, seq_lens, block_size)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_head_layouts() -> None:
    """No GQA with head_size 32, 4 query heads per KV head, and 3 (rows of a program left over) with head_size 8."""
    for num_heads, num_kv_heads, head_size in [(2, 2, 32), (4, 1, 16), (3, 1, 8)]:
        ours, expected = _compare([1, 5], [6, 9], num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size)
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


# Triton's interpreter multiplies bfloat16 blocks wrongly (as raw integers): on CPU float16 runs the 16-bit path.
@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not ON_CUDA, reason="bfloat16 tl.dot is wrong in Triton's interpreter"))])
def test_16_bit(dtype: torch.dtype) -> None:
    ours, expected = _compare([1, 6], [9, 6], dtype=dtype)
    torch.testing.assert_close(ours, expected, atol=2e-3, rtol=2e-3)


def test_padding_tokens_write_nothing_and_output_zero() -> None:
    backend = TritonAttentionBackend()
    common, _ = make_common_metadata([3, 1], [3, 5], [[7], [2, 4]], 4, num_padding_tokens=2)
    common.slot_mapping[1] = -1  # a real token whose K/V must not be written either
    kv_cache = torch.zeros(backend.get_kv_cache_shape(NUM_BLOCKS, 4, 2, 16), device=DEVICE)
    key, value = torch.randn(6, 2, 16, device=DEVICE), torch.randn(6, 2, 16, device=DEVICE)
    output = backend.forward(torch.randn(6, 4, 16, device=DEVICE), key, value, kv_cache,
                             backend.build(_on_device(common)), 1.0)
    written = kv_cache.flatten(1, 2).abs().sum((-1, -2)) != 0  # [2, slots]
    assert written.nonzero().tolist() == [[0, 16], [0, 28], [0, 30], [1, 16], [1, 28], [1, 30]]
    assert torch.equal(kv_cache[0, 7, 2], key[2]) and torch.equal(kv_cache[1, 4, 0], value[3])
    assert torch.all(output[4:] == 0)
    ours, expected = _compare([1, 6], [4, 6], num_padding_tokens=3)
    assert torch.all(ours[7:] == 0)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_choose_attn_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    if ON_CUDA:
        assert choose_attn_backend("auto", "cuda", torch.bfloat16) == TritonAttentionBackend.name
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert choose_attn_backend("triton", "cpu") == TritonAttentionBackend.name
    assert choose_attn_backend("auto", "cpu") != TritonAttentionBackend.name  # the interpreter is for tests
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        choose_attn_backend("triton", "cpu")


def test_engine_matches_torch_backend(llama_path: Path) -> None:
    """Chunked prefill (8 tokens a step) of two prompts across 4-token blocks, then decodes: same greedy tokens."""
    prompts = [{"prompt_token_ids": [5, 17, 99, 3, 250, 41, 8, 77, 300, 12]}, {"prompt_token_ids": [9, 64, 128]}]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    tokens = {}
    for backend in ("triton", "torch"):
        llm = LLM(model=str(llama_path), attention_backend=backend, custom_ops="none", block_size=4, max_model_len=64,
                  max_num_batched_tokens=8, num_gpu_blocks_override=32, enable_prefix_caching=False)
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    assert tokens["triton"] == tokens["torch"]
    assert all(len(t) == 4 for t in tokens["torch"])


@pytest.mark.usefixtures(model_parallel_of_one.__name__)
def test_fixed_buffer_decode_replay_path_samples_the_same(llama_path: Path) -> None:
    """What a FULL CUDA graph of the triton backend replays (the runner's persistent buffers, padding requests with
    seq_len 1 and slot -1, which writes nothing), run eagerly."""
    check_replay_path_samples_the_same(llama_path, attention_backend="triton", block_size=4, device=DEVICE)
