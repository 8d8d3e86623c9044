"""Attention through FlashAttention 2 (`pip install 'raylm[flash]'`): `flash_attn_varlen_func` with `block_table` reads
the paged KV cache directly, for prompts, chunks with context and decodes in one call per layer. A captured decode
graph calls `flash_attn_with_kvcache` instead, whose per-request key counts are a device tensor (`cache_seqlens`), so
it reads only the runner's persistent buffers.

FlashAttention 2 takes a paged cache only in pages of a multiple of 256 tokens, so this backend needs `block_size`
256, 512, ...; it runs fp16 / bf16 on CUDA. New K/V are written through `slot_mapping` first (padding slot -1
writes nothing). The causal mask of a query shorter than its keys is aligned to the end (FlashAttention >= 2.1), which
is what a chunk with context and a decode need. Neither path reads a device value back to the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from raylm.runner.attention.backend import AttentionBackend, AttentionCGSupport, AttentionMetadata
from raylm.runner.attention.common import CommonAttentionMetadata, DecodeGraphBuffers
from raylm.runner.attention.kv_write import write_kv
from raylm.runner.attention.torch_backend import TorchAttentionBackend

PAGE_MULTIPLE = 256  # FlashAttention 2's paged-KV page size must be a multiple of this
DTYPES = (torch.float16, torch.bfloat16)
# flash_attn_with_kvcache splits long decodes into at most this many KV chunks, each with fp32 partial outputs, and
# only while batch x heads leaves SMs idle; 256 SMs bounds every GPU it runs on.
MAX_SPLITS, MAX_SMS = 128, 256


@dataclass
class FlashAttentionMetadata(AttentionMetadata):
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64, -1: write nothing
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    cu_seqlens_k: torch.Tensor  # [B+1] int32: keys of each request (cached + new)
    block_table: torch.Tensor  # [B, max_blocks] int32
    max_seqlen_q: int
    max_seqlen_k: int


@dataclass
class FlashDecodeGraphMetadata(AttentionMetadata):
    """The fixed-buffer decode (runner/attention/common.py, DecodeGraphBuffers): padding requests' K/V go to the
    scratch slot (an index_copy cannot skip rows inside a graph), their output is never read."""

    buffers: DecodeGraphBuffers


def unavailable_reason(device: torch.device, dtype: torch.dtype, block_size: int) -> str | None:
    """Why this backend cannot run here, or None when it can."""
    try:
        import flash_attn  # noqa: F401
    except ImportError as e:
        return f"the flash-attn package does not import ({e}); install it with pip install 'raylm[flash]'"
    if device.type != "cuda":
        return f"it runs on CUDA (device here: {device})"
    if dtype not in DTYPES:
        return f"it runs float16 or bfloat16 (dtype here: {dtype})"
    if block_size % PAGE_MULTIPLE:
        return f"FlashAttention 2 needs block_size a multiple of {PAGE_MULTIPLE} (block_size here: {block_size})"
    return None


class FlashAttentionBackend(AttentionBackend):
    name = "flash_attn"
    cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE  # build_decode_graph

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        # [2, num_blocks, block_size, num_kv_heads, head_size]: each half is the [pages, page size, heads, dim] that
        # flash_attn_varlen_func takes with block_table.
        return TorchAttentionBackend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    def build(self, common: CommonAttentionMetadata) -> FlashAttentionMetadata:
        num_reqs, n = common.num_reqs, common.num_actual_tokens
        seq_lens = common.seq_lens[:num_reqs]
        cu_seqlens_k = torch.zeros(num_reqs + 1, dtype=torch.int32, device=seq_lens.device)
        torch.cumsum(seq_lens, dim=0, out=cu_seqlens_k[1:])
        return FlashAttentionMetadata(self, n, common.slot_mapping[:n], common.query_start_loc[:num_reqs + 1],
                                      cu_seqlens_k, common.block_table[:num_reqs], common.max_query_len,
                                      common.max_seq_len)

    def build_decode_graph(self, buffers: DecodeGraphBuffers) -> FlashDecodeGraphMetadata:
        assert buffers.scratch_slot >= 0, "the fixed-buffer decode writes padding requests' K/V to a scratch slot"
        return FlashDecodeGraphMetadata(self, buffers.slot_mapping.shape[0], buffers)

    def decode_graph_bytes(self, num_reqs: int, max_keys: int, num_heads: int, num_kv_heads: int, head_size: int,
                           element_size: int, block_size: int) -> int:
        """The [B, 1, H, D] output and fp32 log-sum-exp, plus the split-KV partials (fp32 outputs and log-sum-exps),
        which exist only while batch x heads is below the SM count."""
        splits = MAX_SPLITS * MAX_SMS * (head_size + 1) * 4
        return num_reqs * num_heads * (head_size * element_size + 4) + splits

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        if isinstance(metadata, FlashDecodeGraphMetadata):
            return self._forward_decode_graph(query, key, value, kv_cache, metadata, scale)
        from flash_attn import flash_attn_varlen_func

        assert isinstance(metadata, FlashAttentionMetadata)
        num_tokens, num_heads, head_size = query.shape
        n = metadata.num_actual_tokens
        output = query.new_zeros(num_tokens, num_heads * head_size)
        if n == 0:
            return output
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        # Not a boolean mask over the written rows: its nonzero would read a count back to the host every layer.
        write_kv(key_cache.flatten(0, 1), value_cache.flatten(0, 1), metadata.slot_mapping, key, value)
        out = flash_attn_varlen_func(
            query[:n], key_cache, value_cache, metadata.cu_seqlens_q, metadata.cu_seqlens_k, metadata.max_seqlen_q,
            metadata.max_seqlen_k, softmax_scale=scale, causal=True, block_table=metadata.block_table)
        output[:n] = out.flatten(1)
        return output

    @staticmethod
    def _forward_decode_graph(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                              metadata: FlashDecodeGraphMetadata, scale: float) -> torch.Tensor:
        """No host sync and no data-dependent shape: the new K/V go in through an index_copy (padding to the scratch
        slot), then one query token per request attends over its first seq_len keys read through the block table."""
        from flash_attn import flash_attn_with_kvcache

        buffers = metadata.buffers
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        slots = torch.where(buffers.slot_mapping >= 0, buffers.slot_mapping, buffers.scratch_slot)
        key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slots, key)
        value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slots, value)
        out = flash_attn_with_kvcache(query.unsqueeze(1), key_cache, value_cache, cache_seqlens=buffers.seq_lens,
                                      block_table=buffers.block_table, softmax_scale=scale, causal=True)
        return out.reshape(query.shape[0], -1)
