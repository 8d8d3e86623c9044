"""Attention over a paged KV cache with raylm's CPU kernels (`runner/cpu_kernels.py`), in float32 or bfloat16: the
cache holds K/V in the model's dtype (bfloat16 halves the bytes a decode step reads), scores and sums are float32.

New K/V go into the cache through `slot_mapping`; then one kernel call runs causal GQA attention for every
request, prompts included (with the layer's sliding window, logit soft-cap and attention sinks where it has them),
reading each visible cached key once per KV head, with no gather and no padding.
On this kind of CPU it beats torch's SDPA even on fresh prompts of 16-512 tokens (2-3x at 136 tokens).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from raylm.runner import cpu_kernels
from raylm.runner.attention.backend import AttentionBackend, AttentionMetadata
from raylm.runner.attention.common import CommonAttentionMetadata


@dataclass
class CPUAttentionMetadata(AttentionMetadata):
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64, -1: write nothing
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_blocks] int32


class CPUAttentionBackend(AttentionBackend):
    name = "cpu"
    block_size_multiple = 16  # the kernel scores 16 keys per vector step

    @staticmethod
    def is_available() -> bool:
        return cpu_kernels.load() is not None

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        # The key half keeps each (block, head) tile transposed ([head_size, block_size]); see cpu_kernels.cpp.
        return (2, num_blocks, num_kv_heads, block_size, head_size)

    def build(self, common: CommonAttentionMetadata) -> CPUAttentionMetadata:
        assert common.block_table.device.type == "cpu", "the cpu attention backend runs on CPU tensors only"
        num_reqs, n = common.num_reqs, common.num_actual_tokens
        return CPUAttentionMetadata(self, n, common.slot_mapping[:n], common.query_start_loc_cpu[:num_reqs + 1],
                                    common.seq_lens_cpu[:num_reqs], common.block_table[:num_reqs])

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float, sliding_window: int | None = None,
                logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        assert isinstance(metadata, CPUAttentionMetadata)
        ops = cpu_kernels.ops_for(query)
        assert ops is not None, "the cpu attention backend needs float32 or bfloat16 CPU tensors and its built kernels"
        num_tokens, num_heads, head_size = query.shape
        n = metadata.num_actual_tokens
        ops.write_kv(key[:n], value[:n], kv_cache[0], kv_cache[1], metadata.slot_mapping)
        output = query.new_empty(num_tokens, num_heads, head_size)
        if n < num_tokens:  # padding rows
            output[n:].zero_()
        ops.paged_attention(output, query, kv_cache[0], kv_cache[1], metadata.block_table, metadata.seq_lens,
                            metadata.query_start_loc, scale, sliding_window or 0, logits_soft_cap or 0.0,
                            None if sinks is None else sinks.float().contiguous())  # the kernel reads float32 logits
        return output.view(num_tokens, num_heads * head_size)
