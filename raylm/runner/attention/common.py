"""Backend-independent attention metadata of one step, built once by the ModelRunner."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CommonAttentionMetadata:
    """Packed varlen batch of B requests and T tokens (request i owns tokens
    query_start_loc[i]:query_start_loc[i+1]; its query is the last tokens of its sequence)."""

    query_start_loc: torch.Tensor  # [B+1] int32, device
    query_start_loc_cpu: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32, device: computed + scheduled tokens of each request
    seq_lens_cpu: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_blocks_per_req] int32, device
    slot_mapping: torch.Tensor  # [T] int64, device: cache slot of each token (-1: write nothing)
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int


@dataclass
class DecodeGraphBuffers:
    """A uniform decode batch of B requests (B the padded size) as the runner's persistent buffers hold it: what a
    captured CUDA graph reads at fixed addresses. Padding requests have query length 1, slot -1 and seq_len 1 (their
    key 0 is a stale block's: finite, never read back)."""

    slot_mapping: torch.Tensor  # [B] int64, -1: padding
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B+1] int32: 0, 1, ..., B
    block_table: torch.Tensor  # [B, max_blocks_per_req] int32: every column, so the key range is fixed
    scratch_slot: int  # a slot no request owns (the KV cache's extra block), for writes that cannot branch
