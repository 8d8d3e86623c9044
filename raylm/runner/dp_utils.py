"""Lock-step data parallel: before every forward (real or dummy) the DP ranks agree on how it runs.

One all-reduce over the DP group's gloo CPU group (no device sync point, as vLLM does under async scheduling) of an
int32 [4, dp_size] table in which each rank fills only its own column; then every rank applies the same pure
decision to the same table, so all agree on padding, micro-batching and the CUDA-graph mode.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from raylm.runner.batch_descriptor import CUDAGraphMode
from raylm.runner.group_coordinator import GroupCoordinator

NUM_UBATCHES = 2


@dataclass(frozen=True)
class DPBatchDecision:
    should_ubatch: bool
    num_tokens_across_dp: list[int]  # the tokens each DP rank runs on, padding included
    cudagraph_mode: CUDAGraphMode


def coordinate_batch_across_dp(num_tokens_unpadded: int, num_tokens_padded: int, wants_ubatch: bool,
                               cudagraph_mode: CUDAGraphMode, dp_group: GroupCoordinator) -> DPBatchDecision:
    """Every DP rank must call this once per forward, in the same order: it is a collective."""
    assert dp_group.world_size > 1, "a DP group of one needs no coordination"
    table = torch.zeros(4, dp_group.world_size, dtype=torch.int32)
    table[:, dp_group.rank_in_group] = torch.tensor(
        [num_tokens_unpadded, num_tokens_padded, int(wants_ubatch), int(cudagraph_mode)], dtype=torch.int32)
    dp_group.cpu_all_reduce(table)
    num_tokens, padded, ubatch, modes = table.tolist()
    return synchronize_dp_ranks(num_tokens, padded, [bool(u) for u in ubatch], modes)


def synchronize_dp_ranks(num_tokens_unpadded: Sequence[int], num_tokens_padded: Sequence[int],
                         wants_ubatch: Sequence[bool], cudagraph_modes: Sequence[int]) -> DPBatchDecision:
    """The decision every rank takes from the all-reduced table (one entry per DP rank in each argument)."""
    assert len(num_tokens_unpadded) == len(num_tokens_padded) == len(wants_ubatch) == len(cudagraph_modes) > 0
    max_padded = max(num_tokens_padded)
    # Neither side of the cut may be empty on any rank: the first starts at 0 and ends at max_padded // 2.
    should_ubatch = (all(wants_ubatch) and max_padded >= NUM_UBATCHES
                     and not is_last_ubatch_empty(min(num_tokens_unpadded), max_padded))
    cudagraph_mode = CUDAGraphMode(min(cudagraph_modes))
    # Captured graphs and micro-batches need the same size on every rank; an eager forward is not padded.
    if should_ubatch or cudagraph_mode != CUDAGraphMode.NONE:
        num_tokens_across_dp = [max_padded] * len(num_tokens_padded)
    else:
        num_tokens_across_dp = list(num_tokens_padded)
    return DPBatchDecision(should_ubatch, num_tokens_across_dp, cudagraph_mode)


def is_last_ubatch_empty(num_tokens_unpadded: int, num_tokens_padded: int, num_ubatches: int = NUM_UBATCHES) -> bool:
    """The last ubatch starts at (padded // n) * (n - 1); it is all padding when the real tokens end before that.
    Across DP ranks: the fewest real tokens against the largest padded size."""
    return (num_tokens_padded // num_ubatches) * (num_ubatches - 1) >= num_tokens_unpadded
