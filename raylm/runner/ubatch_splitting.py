"""Where a forward is cut in micro-batches (ubatches), and each ubatch's attention metadata.

The padded token range is cut at `num_tokens_padded // 2` (vLLM's token-count split): a request whose tokens
straddle the cut appears in both ubatches, its first part as a shorter sequence, its second part as a query over the
K/V the first ubatch wrote (the first ubatch runs each layer's attention before the second does). Padding rows all
fall in the last ubatch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from raylm.configs import ParallelConfig
from raylm.runner.attention.common import CommonAttentionMetadata
from raylm.runner.dp_utils import NUM_UBATCHES


@dataclass(frozen=True)
class UBatchSlice:
    request_slice: slice  # rows of the batch (a request cut by the split is in both ubatches)
    token_slice: slice  # the ubatch's rows of the padded forward

    @property
    def num_tokens(self) -> int:
        return self.token_slice.stop - self.token_slice.start


def check_ubatch_thresholds(parallel: ParallelConfig, num_tokens: int, uniform_decode: bool) -> bool:
    """Whether this rank wants micro-batches for a forward of `num_tokens` (vLLM's rule; DP ranks then vote)."""
    if not parallel.enable_dbo or num_tokens < NUM_UBATCHES:
        return False
    threshold = parallel.dbo_decode_token_threshold if uniform_decode else parallel.dbo_prefill_token_threshold
    return num_tokens >= threshold


def create_ubatch_slices(cu_num_tokens: np.ndarray | None, num_tokens: int,
                         num_tokens_padded: int) -> list[UBatchSlice]:
    """Two ubatches of the padded range [0, num_tokens_padded). `cu_num_tokens` [num_reqs + 1]: the requests' token
    offsets (query_start_loc); None for a dummy batch (no requests: the request slices are empty)."""
    split = num_tokens_padded // NUM_UBATCHES
    # The DP vote vetoes a cut with an empty side, on every rank (dp_utils.synchronize_dp_ranks).
    assert 0 < split < num_tokens <= num_tokens_padded, (split, num_tokens, num_tokens_padded)
    bounds = [0, split, num_tokens_padded]
    slices = []
    for start, stop in zip(bounds, bounds[1:]):
        if cu_num_tokens is None:
            requests = slice(0, 0)
        else:
            # The request holding token `start`, to the one holding the last real token before `stop`.
            first = int(np.searchsorted(cu_num_tokens, start, side="right")) - 1
            last = int(np.searchsorted(cu_num_tokens, min(stop, num_tokens), side="left"))
            requests = slice(first, last)
        slices.append(UBatchSlice(requests, slice(start, stop)))
    return slices


def slice_attn_metadata(common: CommonAttentionMetadata, ubatch: UBatchSlice) -> CommonAttentionMetadata:
    """The metadata of one ubatch's real tokens: query offsets rebased to the ubatch, and a request cut at the end of
    the ubatch ends its sequence there."""
    r0, r1 = ubatch.request_slice.start, ubatch.request_slice.stop
    t0 = ubatch.token_slice.start
    t1 = min(ubatch.token_slice.stop, common.num_actual_tokens)
    full_starts = common.query_start_loc_cpu[r0:r1 + 1]
    query_start_loc_cpu = (full_starts - t0).clamp_(0, t1 - t0)
    seq_lens_cpu = common.seq_lens_cpu[r0:r1].clone()
    seq_lens_cpu[-1] -= int(full_starts[-1]) - t1  # the cut request's tokens after this ubatch
    query_lens = query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]
    device = common.query_start_loc.device
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc_cpu.to(device, non_blocking=True),
        query_start_loc_cpu=query_start_loc_cpu,
        seq_lens=seq_lens_cpu.to(device, non_blocking=True),
        seq_lens_cpu=seq_lens_cpu,
        block_table=common.block_table[r0:r1],
        slot_mapping=common.slot_mapping[t0:t1],
        num_reqs=r1 - r0,
        num_actual_tokens=t1 - t0,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens_cpu.max()),
    )


def slice_tensors(tensors: dict[str, torch.Tensor] | None, ubatch: UBatchSlice) -> dict[str, torch.Tensor] | None:
    return None if tensors is None else {key: t[ubatch.token_slice] for key, t in tensors.items()}
