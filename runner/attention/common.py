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
