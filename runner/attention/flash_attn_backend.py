"""Attention through FlashAttention 2 (`pip install 'raylm[flash]'`): `flash_attn_varlen_func` with `block_table` reads
the paged KV cache directly, for prompts, chunks with context and decodes in one call per layer.

FlashAttention 2 takes a paged cache only in pages of a multiple of 256 tokens, so this backend needs `block_size`
256, 512, ...; it runs fp16 / bf16 on CUDA. New K/V are written through `slot_mapping` first (padding slot -1
writes nothing). The causal mask of a query shorter than its keys is aligned to the end (FlashAttention >= 2.1), which
is what a chunk with context and a decode need.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runner.attention.backend import AttentionBackend, AttentionMetadata
from runner.attention.common import CommonAttentionMetadata
from runner.attention.torch_backend import TorchAttentionBackend

PAGE_MULTIPLE = 256  # FlashAttention 2's paged-KV page size must be a multiple of this
DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class FlashAttentionMetadata(AttentionMetadata):
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64, -1: write nothing
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    cu_seqlens_k: torch.Tensor  # [B+1] int32: keys of each request (cached + new)
    block_table: torch.Tensor  # [B, max_blocks] int32
    max_seqlen_q: int
    max_seqlen_k: int


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

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        from flash_attn import flash_attn_varlen_func

        assert isinstance(metadata, FlashAttentionMetadata)
        num_tokens, num_heads, head_size = query.shape
        n = metadata.num_actual_tokens
        output = query.new_zeros(num_tokens, num_heads * head_size)
        if n == 0:
            return output
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        written = metadata.slot_mapping >= 0
        slots = metadata.slot_mapping[written]
        key_cache.view(-1, *key_cache.shape[2:])[slots] = key[:n][written]
        value_cache.view(-1, *value_cache.shape[2:])[slots] = value[:n][written]
        out = flash_attn_varlen_func(
            query[:n], key_cache, value_cache, metadata.cu_seqlens_q, metadata.cu_seqlens_k, metadata.max_seqlen_q,
            metadata.max_seqlen_k, softmax_scale=scale, causal=True, block_table=metadata.block_table)
        output[:n] = out.flatten(1)
        return output
