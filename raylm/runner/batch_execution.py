"""How one forward runs (stage C of execute_model), a ModelRunner mixin as vLLM's runner mixins are.

Every forward (a step, a dummy batch, the profile run) goes through `_determine_batch_execution_and_padding` and
then `_run_forward`, the only caller of the model. The decision is one BatchDescriptor: the CUDA-graph mode and
padded size (CudagraphDispatcher), whether the forward runs as two micro-batches (dual batch overlap), and under
lock-step data parallel what every DP rank agreed on in the one coordination all-reduce of the forward.
Padding rows (token 0, position 0, slot -1) follow the real tokens: they write no KV and are never sampled.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from raylm.common import tracing
from raylm.common.logger import show_info
from raylm.common.outputs import IntermediateTensors
from raylm.configs import EngineConfig
from raylm.configs.model_info import ModelInfo
from raylm.runner.attention.backend import AttentionBackend, AttentionCGSupport
from raylm.runner.attention.common import CommonAttentionMetadata
from raylm.runner.batch_descriptor import BatchDescriptor, CUDAGraphMode
from raylm.runner.cuda_graph import CUDAGraphRunner
from raylm.runner.cudagraph_dispatcher import CudagraphDispatcher
from raylm.runner.dp_utils import coordinate_batch_across_dp
from raylm.runner.forward_context import set_forward_context
from raylm.runner.forward_log import ForwardLog
from raylm.runner.group_coordinator import GroupCoordinator
from raylm.runner.input_buffers import InputBuffersMixin
from raylm.runner.layers.fused_moe import why_grouped_mm_syncs
from raylm.runner.parallel_state import get_pp_group
from raylm.runner.ubatch_splitting import (
    UBatchSlice,
    check_ubatch_thresholds,
    create_ubatch_slices,
    slice_attn_metadata,
    slice_tensors,
)
from raylm.runner.ubatching import run_ubatches

logger = logging.getLogger(__name__)


class BatchExecutionMixin(InputBuffersMixin):
    # Set by the ModelRunner.
    config: EngineConfig
    model_info: ModelInfo
    dtype: torch.dtype
    model: torch.nn.Module | None
    attn_backend: AttentionBackend
    dp_group: GroupCoordinator | None
    num_dp_coordinations: int

    def _init_batch_execution(self) -> None:
        device = self.device
        why_not_full = self._why_no_full_graphs()
        self.cudagraph_dispatcher = CudagraphDispatcher(self.config.compilation_config, self.config.scheduler_config,
                                                        device.type, allow_full=why_not_full is None)
        if why_not_full and device.type == "cuda" and self.cudagraph_dispatcher.mode_name != "NONE":
            logger.info("cudagraph_mode %s: no FULL CUDA graphs (%s); decode batches run eagerly",
                        self.cudagraph_dispatcher.mode_name, why_not_full)
        self.graph_runner: CUDAGraphRunner | None = None
        self.forward_log = ForwardLog()  # the graph key of recent forwards, for scripts/gpu_check.py
        self.num_padded_forwards = 0
        self.num_ubatched_forwards = 0
        self.log_batch_execution = self.config.observability_config.log_batch_execution
        if self.log_batch_execution:
            show_info(logger)

    def _why_no_full_graphs(self) -> str | None:
        """Why this model cannot replay as one captured graph (None: it can). On CPU nothing is captured: FULL only
        pads there (so tests run the padding paths), whatever the attention backend or the experts' matmul."""
        if self.model_info.is_moe and self.device.type == "cuda":
            reason = why_grouped_mm_syncs(self.device, self.dtype)
            if reason is not None:
                return reason
        if self.config.parallel_config.pipeline_parallel_size > 1:
            return "pipeline stages exchange tensors between forwards"
        if self.device.type == "cuda" and self.attn_backend.cudagraph_support == AttentionCGSupport.NEVER:
            return f"attention backend {self.attn_backend.name!r} has no fixed-buffer decode"
        return None

    @torch.inference_mode()
    def execute_dummy_batch(self) -> None:
        """A forward of one placeholder token, so that an idle DP rank joins the collectives of the ranks with work."""
        self._dummy_run(1)

    def _dummy_run(self, num_tokens: int, uniform_decode: bool = True) -> torch.Tensor | IntermediateTensors:
        """A forward of `num_tokens` zero tokens at position 0, without attention metadata (causal attention over the
        batch, the KV cache untouched). The InputBatch and execute_model_state are untouched; nothing is sampled."""
        num_reqs = num_tokens if uniform_decode else min(num_tokens, self.max_num_reqs)
        self._pad_inputs(0, num_tokens)  # a dummy batch is padding only
        return self._run_forward(num_tokens, num_reqs, uniform_decode, None, None)

    def _determine_batch_execution_and_padding(self, num_tokens: int, num_reqs: int,
                                               uniform_decode: bool) -> BatchDescriptor:
        """The CUDA-graph mode and padded size from the dispatcher and (lock-step DP) whether this rank wants
        micro-batches; DP ranks then agree on one plan: the lowest mode, every rank padded to the largest size when
        graphs or micro-batches need equal sizes, micro-batches only if every rank wants them and neither side of
        the cut is empty anywhere."""
        cudagraph_mode, num_tokens_padded = self.cudagraph_dispatcher.dispatch(num_tokens, uniform_decode)
        dp = self.dp_group
        assert dp is not None, "load_model first"
        if dp.world_size == 1:
            return BatchDescriptor(num_tokens, num_tokens_padded, num_reqs, uniform_decode, cudagraph_mode)
        wants_ubatch = check_ubatch_thresholds(self.config.parallel_config, num_tokens, uniform_decode)
        decision = coordinate_batch_across_dp(num_tokens, num_tokens_padded, wants_ubatch, cudagraph_mode, dp)
        self.num_dp_coordinations += 1
        return BatchDescriptor(num_tokens, decision.num_tokens_across_dp[dp.rank_in_group], num_reqs, uniform_decode,
                               decision.cudagraph_mode, decision.should_ubatch, decision.num_tokens_across_dp)

    def _run_forward(self, num_tokens: int, num_reqs: int, uniform_decode: bool,
                     common: CommonAttentionMetadata | None,
                     intermediate_tensors: IntermediateTensors | None) -> torch.Tensor | IntermediateTensors:
        """The one call of the model, always after the batch decision (so after the DP coordination). The first
        `num_tokens` input rows are written; padding rows are filled here. `common` None: a dummy batch. A later
        pipeline stage without received tensors (dummy and profile runs: no stage-to-stage traffic) runs on zeros."""
        assert self.model is not None, "load_model first"
        with tracing.span("batch_decision", dp_sync=self.dp_group is not None and self.dp_group.world_size > 1):
            batch_descriptor = self._determine_batch_execution_and_padding(num_tokens, num_reqs, uniform_decode)
        n = batch_descriptor.num_tokens_padded
        if n > num_tokens:
            self._pad_inputs(num_tokens, n)
            self.num_padded_forwards += 1
        if intermediate_tensors is None and not get_pp_group().is_first_rank:
            intermediate_tensors = self.model.make_empty_intermediate_tensors(n, self.dtype, self.device)
        # The previous stage took the same decision for the same batch, so it sent n rows.
        assert intermediate_tensors is None or intermediate_tensors["hidden_states"].shape[0] == n
        ubatch_slices = None
        if batch_descriptor.should_ubatch:
            cu_num_tokens = None if common is None else self.query_start_loc.np[:num_reqs + 1]
            ubatch_slices = create_ubatch_slices(cu_num_tokens, num_tokens, n)
        if self.log_batch_execution:
            _log_batch_execution(batch_descriptor, ubatch_slices)
        graphs = self.graph_runner
        should_replay = (batch_descriptor.cudagraph_mode == CUDAGraphMode.FULL and common is not None
                         and graphs is not None and ubatch_slices is None)
        replay = (should_replay and graphs is not None and common is not None and graphs.has(n)
                  and self.attn_backend.decode_graph_fits(common.seq_lens_cpu, n, self.kv_caches[0],
                                                          self.max_blocks_per_req))
        self.forward_log.record(batch_descriptor, should_replay, replay)
        if ubatch_slices is not None:
            with tracing.span("forward", num_tokens=n, ubatches=len(ubatch_slices)):
                return self._run_ubatches(batch_descriptor, ubatch_slices, common, intermediate_tensors)
        if replay:
            assert graphs is not None
            assert uniform_decode and num_reqs == num_tokens, "FULL graphs are captured for uniform decode batches"
            self._pad_decode_graph_inputs(num_reqs, n)
            with tracing.span("forward", num_tokens=n, cuda_graph=True):
                return graphs.replay(n)
        attn_metadata = None if common is None else self.attn_backend.build(common)
        with set_forward_context(attn_metadata, n, batch_descriptor), tracing.span("forward", num_tokens=n):
            return self.model(self.input_ids.gpu[:n], self.positions.gpu[:n], intermediate_tensors)

    def _run_ubatches(self, batch_descriptor: BatchDescriptor, ubatch_slices: list[UBatchSlice],
                      common: CommonAttentionMetadata | None,
                      intermediate_tensors: IntermediateTensors | None) -> torch.Tensor | IntermediateTensors:
        """Dual batch overlap: each ubatch on its own thread with its own attention metadata, outputs concatenated in
        token order (the rows an unsliced forward gives)."""
        model = self.model
        assert model is not None
        tensors = None if intermediate_tensors is None else intermediate_tensors.tensors

        def forward(ubatch: UBatchSlice) -> Any:
            sliced = slice_tensors(tensors, ubatch)
            received = None if sliced is None else IntermediateTensors(sliced)
            rows = ubatch.token_slice
            return lambda: model(self.input_ids.gpu[rows], self.positions.gpu[rows], received)

        metadata = [None if common is None else self.attn_backend.build(slice_attn_metadata(common, ubatch))
                    for ubatch in ubatch_slices]
        outputs = run_ubatches([forward(ubatch) for ubatch in ubatch_slices], metadata,
                               [ubatch.num_tokens for ubatch in ubatch_slices], batch_descriptor, self.device)
        self.num_ubatched_forwards += 1
        if isinstance(outputs[0], IntermediateTensors):
            return IntermediateTensors({key: torch.cat([out[key] for out in outputs]) for key in outputs[0].tensors})
        return torch.cat(outputs)


def _log_batch_execution(descriptor: BatchDescriptor, ubatch_slices: list[UBatchSlice] | None) -> None:
    split = "none" if ubatch_slices is None else " | ".join(
        f"tokens {u.token_slice.start}:{u.token_slice.stop} reqs {u.request_slice.start}:{u.request_slice.stop}"
        for u in ubatch_slices)
    logger.info("forward: %d tokens of %d requests%s, padded to %d, cudagraph %s, ubatches %s, DP tokens %s",
                descriptor.num_tokens, descriptor.num_reqs, " (uniform decode)" if descriptor.uniform_decode else "",
                descriptor.num_tokens_padded, descriptor.cudagraph_mode.name, split, descriptor.num_tokens_across_dp)
