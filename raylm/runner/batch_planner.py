"""The batch decision of one forward (vLLM's `_determine_batch_execution_and_padding`): one BatchDescriptor.

It fixes the CUDA-graph mode and padded size (CudagraphDispatcher), whether the forward runs as two micro-batches
(dual batch overlap), and, under lock-step data parallel, what every DP rank agreed on in the one coordination
all-reduce of the forward. Every forward (a step, a dummy batch, the profile run) takes it, so no DP rank can skip a
collective the others wait in.
"""
from __future__ import annotations

import logging

from raylm.configs import ParallelConfig
from raylm.runner.batch_descriptor import BatchDescriptor
from raylm.runner.cudagraph_dispatcher import CudagraphDispatcher
from raylm.runner.dp_utils import coordinate_batch_across_dp
from raylm.runner.group_coordinator import GroupCoordinator
from raylm.runner.ubatch_splitting import UBatchSlice, check_ubatch_thresholds

logger = logging.getLogger(__name__)


class BatchPlanner:
    def __init__(self, dispatcher: CudagraphDispatcher, parallel_config: ParallelConfig, dp_group: GroupCoordinator,
                 lockstep: bool) -> None:
        """`lockstep`: the resolved dp_lockstep; then `dp_group` holds every DP engine's rank of this stage."""
        self.dispatcher = dispatcher
        self.parallel_config = parallel_config
        self.dp_group = dp_group
        # Whether each decision is agreed with the other DP ranks (lock-step data parallel).
        self.coordinates = lockstep

    def determine_batch_execution_and_padding(self, num_tokens: int, num_reqs: int, uniform_decode: bool,
                                              has_lora: bool = False) -> BatchDescriptor:
        """The CUDA-graph mode and padded size from the dispatcher and (lock-step DP) whether this rank wants
        micro-batches; DP ranks then agree on one plan: the lowest mode, every rank padded to the largest size when
        graphs or micro-batches need equal sizes, micro-batches only if every rank wants them and neither side of
        the cut is empty anywhere."""
        cudagraph_mode, num_tokens_padded = self.dispatcher.dispatch(num_tokens, uniform_decode, has_lora)
        dp = self.dp_group
        if not self.coordinates:
            return BatchDescriptor(num_tokens, num_tokens_padded, num_reqs, uniform_decode, cudagraph_mode,
                                   has_lora=has_lora)
        wants_ubatch = check_ubatch_thresholds(self.parallel_config, num_tokens, uniform_decode)
        decision = coordinate_batch_across_dp(num_tokens, num_tokens_padded, wants_ubatch, cudagraph_mode, dp)
        return BatchDescriptor(num_tokens, decision.num_tokens_across_dp[dp.rank_in_group], num_reqs, uniform_decode,
                               decision.cudagraph_mode, decision.should_ubatch, decision.num_tokens_across_dp,
                               has_lora)


def log_batch_execution(descriptor: BatchDescriptor, ubatch_slices: list[UBatchSlice] | None) -> None:
    split = "none" if ubatch_slices is None else " | ".join(
        f"tokens {u.token_slice.start}:{u.token_slice.stop} reqs {u.request_slice.start}:{u.request_slice.stop}"
        for u in ubatch_slices)
    logger.info("forward: %d tokens of %d requests%s, padded to %d, cudagraph %s, ubatches %s, DP tokens %s",
                descriptor.num_tokens, descriptor.num_reqs, " (uniform decode)" if descriptor.uniform_decode else "",
                descriptor.num_tokens_padded, descriptor.cudagraph_mode.name, split, descriptor.num_tokens_across_dp)
