"""Attention over a paged KV cache with two Triton kernels (`runner/attention/triton_kernels.py`): one writes new
K/V through `slot_mapping`, one runs causal GQA attention for every request of the step (prompts, chunks with
context, decodes), reading keys through the block table with no gather and no padding to the longest request.

It runs on CUDA, and on CPU tensors under `TRITON_INTERPRET=1` (slow: for tests). The KV cache layout is the torch
backend's, so either backend reads the other's cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from raylm.runner.attention import triton_kernels
from raylm.runner.attention.backend import AttentionBackend, AttentionCGSupport, AttentionMetadata
from raylm.runner.attention.common import CommonAttentionMetadata, DecodeGraphBuffers
from raylm.runner.attention.torch_backend import TorchAttentionBackend

# Keys per inner step of the attention kernel, and query rows per program for decode-only and other batches.
TILE_N = 32
DECODE_BLOCK_M, PREFILL_BLOCK_M = 16, 64


@dataclass
class TritonAttentionMetadata(AttentionMetadata):
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64, -1: write nothing
    query_start_loc: torch.Tensor  # [B+1] int32, device
    seq_lens: torch.Tensor  # [B] int32, device
    block_table: torch.Tensor  # [B, max_blocks] int32, device
    num_reqs: int
    max_query_len: int


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    # The kernels read every per-request value from device tensors, so the runner's persistent buffers serve as they
    # are; the launch's Python numbers (tokens, requests, grid) are those of the padded size a graph is captured for.
    cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return TorchAttentionBackend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    def build(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        num_reqs, n = common.num_reqs, common.num_actual_tokens
        return TritonAttentionMetadata(self, n, common.slot_mapping[:n], common.query_start_loc[:num_reqs + 1],
                                       common.seq_lens[:num_reqs], common.block_table[:num_reqs], num_reqs,
                                       common.max_query_len)

    def build_decode_graph(self, buffers: DecodeGraphBuffers) -> TritonAttentionMetadata:
        num_reqs = buffers.slot_mapping.shape[0]
        return TritonAttentionMetadata(self, num_reqs, buffers.slot_mapping, buffers.query_start_loc, buffers.seq_lens,
                                       buffers.block_table, num_reqs, max_query_len=1)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float, sliding_window: int | None = None,
                logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        assert isinstance(metadata, TritonAttentionMetadata)
        num_tokens, num_heads, head_size = query.shape
        num_kv_heads, block_size = key.shape[1], kv_cache.shape[2]
        assert num_heads % num_kv_heads == 0, f"{num_heads} query heads do not share {num_kv_heads} KV heads evenly"
        assert query.stride(2) == key.stride(2) == value.stride(2) == 1, "the kernels read head_size contiguously"
        assert kv_cache.is_contiguous(), "both cache halves must share their strides"
        n = metadata.num_actual_tokens
        key_cache, value_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, num_kv_heads, head_size]
        output = query.new_empty(num_tokens, num_heads * head_size)
        if n < num_tokens:  # padding rows
            output[n:].zero_()
        if n == 0:
            return output
        head_p2 = max(16, triton.next_power_of_2(head_size))  # tl.dot needs every dimension >= 16
        triton_kernels.write_kv[(n,)](
            key, value, key_cache, value_cache, metadata.slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            block_size, num_kv_heads, head_size,
            KV_HEADS_P2=triton.next_power_of_2(num_kv_heads), HEAD_P2=head_p2)

        queries_per_kv = num_heads // num_kv_heads
        block_m = max(DECODE_BLOCK_M if metadata.max_query_len == 1 else PREFILL_BLOCK_M,
                      triton.next_power_of_2(queries_per_kv))
        block_q = block_m // queries_per_kv
        # Request r's query blocks are numbered from query_start_loc[r] // block_q + r: this bound covers them all.
        num_q_blocks = n // block_q + metadata.num_reqs
        triton_kernels.paged_attention[(num_q_blocks, num_kv_heads)](
            output, query, key_cache, value_cache, metadata.block_table, metadata.seq_lens,
            metadata.query_start_loc, query if sinks is None else sinks, scale, metadata.num_reqs,
            output.stride(0), query.stride(0), query.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), metadata.block_table.stride(0),
            block_size, head_size, sliding_window or 0, logits_soft_cap or 1.0,
            QUERIES_PER_KV=queries_per_kv, BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=TILE_N, HEAD_P2=head_p2,
            # float32 stays float32 (no TF32); None: the default of 16-bit inputs
            DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,
            SLIDING=sliding_window is not None, SOFT_CAP=logits_soft_cap is not None, SINKS=sinks is not None)
        return output
