"""The torch attention backend against a naive per-request reference over the same paged cache."""
from __future__ import annotations

import pytest
import torch

from raylm.runner.attention import choose_attn_backend
from raylm.runner.attention.common import CommonAttentionMetadata
from raylm.runner.attention.torch_backend import TorchAttentionBackend

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 8, 4, 40


def make_common_metadata(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                         block_size: int, num_padding_tokens: int = 0) -> tuple[CommonAttentionMetadata, torch.Tensor]:
    """Metadata of a packed batch (each request's query is the tail of its sequence) and the token positions.
    Padding tokens after the real ones get slot -1."""
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens, strict=True)])
    req_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    width = max(len(table) for table in block_tables)
    block_table = torch.tensor([table + [0] * (width - len(table)) for table in block_tables], dtype=torch.int32)
    slots = block_table[req_of_token, positions // block_size].long() * block_size + positions % block_size
    slot_mapping = torch.cat([slots, torch.full((num_padding_tokens,), -1, dtype=torch.int64)])
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=query_start_loc, query_start_loc_cpu=query_start_loc.clone(), seq_lens=seq_lens_t,
        seq_lens_cpu=seq_lens_t.clone(), block_table=block_table, slot_mapping=slot_mapping,
        num_reqs=len(query_lens), num_actual_tokens=sum(query_lens), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens))
    return common, torch.cat([positions, torch.zeros(num_padding_tokens, dtype=torch.int64)])


def _random_block_tables(seq_lens: list[int], generator: torch.Generator) -> list[list[int]]:
    free = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    return [[free.pop() for _ in range(-(-s // BLOCK_SIZE))] for s in seq_lens]


def _reference(query: torch.Tensor, kv_cache: torch.Tensor, query_lens: list[int], seq_lens: list[int],
               block_tables: list[list[int]], scale: float) -> torch.Tensor:
    """Per request, in float64: gather its keys position by position, causal softmax attention, GQA by repeat."""
    outputs, start = [], 0
    for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(s_len)]
        k = kv_cache[0].flatten(0, 1)[slots].double().repeat_interleave(HEADS // KV_HEADS, dim=1)  # [S, H, D]
        v = kv_cache[1].flatten(0, 1)[slots].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
        q = query[start:start + q_len].double()  # [Q, H, D]
        scores = torch.einsum("qhd,shd->hqs", q, k) * scale
        visible = torch.arange(s_len)[None, :] <= torch.arange(s_len - q_len, s_len)[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        outputs.append(torch.einsum("hqs,shd->qhd", probs, v).flatten(1))
        start += q_len
    return torch.cat(outputs)


def _run(query_lens: list[int], seq_lens: list[int], seed: int = 0,
         num_padding_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    generator = torch.Generator().manual_seed(seed)
    backend = TorchAttentionBackend()
    block_tables = _random_block_tables(seq_lens, generator)
    common, _ = make_common_metadata(query_lens, seq_lens, block_tables, BLOCK_SIZE, num_padding_tokens)
    shape = backend.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
    kv_cache = torch.randn(shape, generator=generator)  # stands in for the context computed in earlier steps
    num_tokens = sum(query_lens) + num_padding_tokens
    query = torch.randn(num_tokens, HEADS, HEAD_SIZE, generator=generator)
    key, value = (torch.randn(num_tokens, KV_HEADS, HEAD_SIZE, generator=generator) for _ in range(2))
    output = backend.forward(query, key, value, kv_cache, backend.build(common), HEAD_SIZE**-0.5)
    expected = _reference(query, kv_cache, query_lens, seq_lens, block_tables, HEAD_SIZE**-0.5)
    return output, expected, kv_cache, block_tables


def test_choose_attn_backend() -> None:
    assert choose_attn_backend("auto", "cpu", torch.float32, block_size=4) == TorchAttentionBackend.name
    # float16 has no CPU kernel (float32 and bfloat16 take raylm's: tests/test_cpu_kernels.py)
    assert choose_attn_backend("auto", "cpu", torch.float16) == TorchAttentionBackend.name
    assert choose_attn_backend("torch", "cpu") == TorchAttentionBackend.name
    # triton: tests/test_attention_triton.py; flash_attn runs 16-bit on CUDA with pages of 256 tokens
    with pytest.raises(ValueError, match="attention_backend 'flash_attn' is not available: "):
        choose_attn_backend("flash_attn", "cpu", torch.float16, block_size=256)
    with pytest.raises(ValueError, match="unknown attention backend"):
        choose_attn_backend("nope", "cpu")


def test_slot_mapping_writes_land_in_their_slots() -> None:
    backend = TorchAttentionBackend()
    block_tables = [[5, 9], [2]]
    common, positions = make_common_metadata([6, 3], [6, 3], block_tables, BLOCK_SIZE)
    kv_cache = torch.zeros(backend.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE))
    key, value = torch.randn(9, KV_HEADS, HEAD_SIZE), torch.randn(9, KV_HEADS, HEAD_SIZE)
    backend.forward(torch.randn(9, HEADS, HEAD_SIZE), key, value, kv_cache, backend.build(common), 1.0)
    expected = torch.zeros_like(kv_cache)
    for token, (req, pos) in enumerate(zip([0] * 6 + [1] * 3, positions.tolist(), strict=True)):
        block, offset = block_tables[req][pos // BLOCK_SIZE], pos % BLOCK_SIZE
        expected[0, block, offset], expected[1, block, offset] = key[token], value[token]
    assert torch.equal(kv_cache, expected)


def test_negative_slot_writes_nothing() -> None:
    backend = TorchAttentionBackend()
    common, _ = make_common_metadata([3], [3], [[7]], BLOCK_SIZE, num_padding_tokens=2)
    common.slot_mapping[1] = -1
    kv_cache = torch.zeros(backend.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE))
    key, value = torch.randn(5, KV_HEADS, HEAD_SIZE), torch.randn(5, KV_HEADS, HEAD_SIZE)
    output = backend.forward(torch.randn(5, HEADS, HEAD_SIZE), key, value, kv_cache, backend.build(common), 1.0)
    written = kv_cache.flatten(1, 2).abs().sum((-1, -2)) != 0  # [2, slots]
    assert written.nonzero().tolist() == [[0, 28], [0, 30], [1, 28], [1, 30]]
    assert torch.equal(kv_cache[0, 7, 2], key[2])
    assert output.shape == (5, HEADS * HEAD_SIZE) and torch.all(output[3:] == 0)


@pytest.mark.parametrize(("query_lens", "seq_lens"), [
    ([1, 7, 1, 5, 1], [9, 7, 3, 12, 1]),  # decodes of different lengths, a prefill, a chunk with context
    ([1, 1, 1], [6, 6, 6]),  # uniform decodes: no mask
    ([9], [9]),  # one prompt: plain causal
    ([4, 4], [4, 4]),  # equal prompts: plain causal, batched
    ([3, 2], [10, 5]),  # chunks with context, same group
    ([1, 16, 1], [2, 16, 33]),  # one long prefill between decodes, across several blocks
    ([5, 6, 6], [5, 6, 6]),  # prompts of close lengths: padded to the longest, one masked call
    ([1, 3, 9, 2, 1], [5, 3, 9, 6, 1]),  # prompts of far-apart lengths packed block-diagonally, beside the rest
])
def test_matches_naive_reference(query_lens: list[int], seq_lens: list[int]) -> None:
    output, expected, _, _ = _run(query_lens, seq_lens)
    assert output.shape == (sum(query_lens), HEADS * HEAD_SIZE)
    torch.testing.assert_close(output.double(), expected, atol=1e-5, rtol=1e-5)


def test_padding_tokens_are_ignored() -> None:
    output, expected, _, _ = _run([1, 6], [4, 6], num_padding_tokens=3)
    torch.testing.assert_close(output[:7].double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.all(output[7:] == 0)
