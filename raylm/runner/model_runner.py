"""ModelRunner: everything one device does in a step.

execute_model: apply the scheduler's diff to the persistent InputBatch, prepare the packed
inputs into persistent buffers, decide how the batch runs, run the forward, keep the logits (ExecuteModelState).
sample_tokens: sample from the kept logits and append the tokens to the batch.

Every forward (a step, a dummy batch, the profile run of runner/profile_run.py) goes through
`_determine_batch_execution_and_padding` and then `_run_forward` (runner/batch_execution.py), the only caller of the
model: under lock-step data parallel each forward joins the DP ranks' coordination, so no rank can skip a collective
the others wait in. The decision (one BatchDescriptor) fixes the CUDA-graph mode and padded size, and whether the
forward runs as two micro-batches.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from raylm.common import tracing
from raylm.common.outputs import IntermediateTensors, ModelRunnerOutput, SchedulerOutput
from raylm.configs import EngineConfig
from raylm.configs.model_info import ModelInfo
from raylm.runner import cpu_kernels
from raylm.runner.attention import get_attn_backend
from raylm.runner.batch_execution import BatchExecutionMixin
from raylm.runner.cuda_graph import CUDAGraphCaptureMixin
from raylm.runner.group_coordinator import GroupCoordinator
from raylm.runner.host_sync import to_host
from raylm.runner.input_batch import CachedRequestState, InputBatch
from raylm.runner.models.loader import load_model, reload_weights
from raylm.runner.parallel_state import get_dp_group, get_pp_group
from raylm.runner.profile_run import ProfileRunMixin
from raylm.runner.prompt_logprobs import PromptLogprobsProcessor
from raylm.runner.sampler import Sampler
from raylm.runner.sampling_inputs import SamplingMetadataBuilder, to_logprobs_lists
from raylm.runner.sleep_mode import SleepModeMixin
from raylm.runner.ubatching import current_ubatch_id

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class ExecuteModelState:
    """What execute_model leaves for sample_tokens."""

    scheduler_output: SchedulerOutput
    logits: torch.Tensor  # [num_sampling_reqs, vocab]
    sampling_rows: np.ndarray  # InputBatch rows that sample, in logits order


class _CallCounter:
    """A forward pre-hook that counts forwards: a micro-batched forward calls the model once per ubatch and counts
    once. Not a runner method: the model would then keep the runner alive."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        if not current_ubatch_id():
            self.count += 1


class ModelRunner(BatchExecutionMixin, ProfileRunMixin, CUDAGraphCaptureMixin, SleepModeMixin):
    def __init__(self, config: EngineConfig, model_info: ModelInfo, device: torch.device) -> None:
        self.config = config
        self.model_info = model_info
        self.device = device
        self.dtype = _TORCH_DTYPES[model_info.dtype]
        self.block_size = config.cache_config.block_size
        self.max_model_len = model_info.max_model_len
        self.max_num_reqs = config.scheduler_config.max_num_seqs
        self.max_num_tokens = config.scheduler_config.max_num_batched_tokens
        self.max_blocks_per_req = -(-self.max_model_len // self.block_size)

        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch = InputBatch(self.max_num_reqs, self.max_model_len, self.max_blocks_per_req,
                                      model_info.vocab_size)
        cpu_kernels.set_enabled(config.compilation_config.custom_ops != "none")
        self.attn_backend = get_attn_backend(config.cache_config.attention_backend, device, self.dtype,
                                             self.block_size)
        self.sampler = Sampler()
        self.sampling_metadata = SamplingMetadataBuilder(model_info.eos_token_ids, device)
        self.prompt_logprobs = PromptLogprobsProcessor(self.max_num_reqs)
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.execute_model_state: ExecuteModelState | None = None
        self._init_input_buffers()
        # Known at load_model (a runner is built before, and tested without, the process groups).
        self.dp_group: GroupCoordinator | None = None
        # For tests: under lock-step DP every forward is coordinated, so the two are always equal.
        self._forward_counter = _CallCounter()
        self.num_dp_coordinations = 0
        self.scratch_slot = -1  # the KV cache's extra slot that padded decode rows write to inside a graph
        self._init_batch_execution()
        self._init_sleep_mode()

    # ---- set-up ----------------------------------------------------------------------------

    def load_model(self) -> None:
        parallel = self.config.parallel_config
        pp = get_pp_group()
        self.model = load_model(self.model_info.path, dtype=self.dtype, device=self.device,
                                pp_rank=pp.rank_in_group, pp_size=pp.world_size,
                                partition=parallel.pp_layer_partition)
        self.dp_group = get_dp_group()
        # A hook counts every forward, on whatever path it comes.
        self.model.register_forward_pre_hook(self._forward_counter)

    def reload_weights(self) -> None:
        assert self.model is not None, "load_model first"
        reload_weights(self.model, self.model_info.path)

    @property
    def num_forwards(self) -> int:
        return self._forward_counter.count

    def attention_layers(self) -> list[torch.nn.Module]:
        from raylm.runner.layers.attention import Attention

        assert self.model is not None, "load_model first"
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    def kv_cache_bytes_per_block(self) -> int:
        element_size = torch.empty((), dtype=self.dtype).element_size()
        total = 0
        for layer in self.attention_layers():
            shape = self.attn_backend.get_kv_cache_shape(1, self.block_size, layer.num_kv_heads, layer.head_size)
            total += int(np.prod(shape)) * element_size
        return total

    def initialize_kv_cache(self, num_blocks: int) -> None:
        # A pool smaller than max_model_len is allowed: the scheduler rejects each request that could never fit.
        self.kv_caches = []
        # One block past the scheduler's: inside a graph, padded rows write there (no per-row branch is possible).
        extra = 1 if self._captures_decode_graphs() else 0
        self.scratch_slot = num_blocks * self.block_size if extra else -1
        for layer in self.attention_layers():
            shape = self.attn_backend.get_kv_cache_shape(num_blocks + extra, self.block_size, layer.num_kv_heads,
                                                         layer.head_size)
            layer.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.kv_caches.append(layer.kv_cache)

    # ---- one step --------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput,
                      intermediate_tensors: IntermediateTensors | None = None,
                      ) -> ModelRunnerOutput | IntermediateTensors | None:
        if self.execute_model_state is not None:
            raise RuntimeError("execute_model called twice without sample_tokens: the previous step's logits "
                               "were never sampled")
        with tracing.span("update_states"):
            self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            if self.dp_group is not None and self.dp_group.world_size > 1:
                # The other DP ranks' forwards wait for this one in their collectives.
                self._dummy_run(1)
            return ModelRunnerOutput.empty()
        assert self.model is not None and self.kv_caches, "load_model and initialize_kv_cache come first"
        pp = get_pp_group()
        assert pp.is_first_rank or intermediate_tensors is not None, "a later pipeline stage needs the tensors sent"

        with tracing.span("prepare_inputs"):
            common, num_tokens, sampling_rows, logits_indices = self._prepare_inputs(scheduler_output)
        num_reqs = self.input_batch.num_reqs
        # Each request in the batch has at least one scheduled token: as many tokens as requests is all decode.
        output = self._run_forward(num_tokens, num_reqs, num_tokens == num_reqs, common, intermediate_tensors)
        if not pp.is_last_rank:
            return output
        assert isinstance(output, torch.Tensor)
        # Padding rows (if any) come after the real tokens: logits_indices never reach them.
        with tracing.span("compute_logits"):
            logits = self.model.compute_logits(output[logits_indices]).float()
            self.prompt_logprobs.compute(output, self.input_batch, self.query_start_loc.np, self.model.compute_logits)
        self.execute_model_state = ExecuteModelState(scheduler_output, logits, sampling_rows)
        return None

    @torch.inference_mode()
    def sample_tokens(self) -> ModelRunnerOutput | None:
        state = self.execute_model_state
        if state is None:
            return None  # non-last pipeline stage, or execute_model already answered
        self.execute_model_state = None
        batch = self.input_batch
        rows = state.sampling_rows
        with tracing.span("sample"):
            sampler_output = self.sampler(state.logits, self.sampling_metadata.build(batch, rows))
            sampled = to_host(sampler_output.sampled_token_ids)[0].tolist()  # the step's one host wait
        batch.append_sampled(rows, sampled)

        req_ids = batch.req_ids[: batch.num_reqs]
        if len(sampled) == len(req_ids):  # every row samples, in row order
            sampled_token_ids = [[token] for token in sampled]
        else:
            sampled_token_ids = [[] for _ in req_ids]
            for row, token in zip(rows.tolist(), sampled):
                sampled_token_ids[row] = [token]
        logprobs = to_logprobs_lists(batch, rows, sampler_output.logprobs_tensors)
        return ModelRunnerOutput(list(req_ids), sampled_token_ids, logprobs, self.prompt_logprobs.pop_completed())

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
            self.prompt_logprobs.remove_request(req_id)
            batch.remove_request(req_id)
        # Requests not scheduled this step leave the batch but keep their state (the order of removals does not
        # matter: holes are refilled lowest first).
        for req_id in batch.req_id_to_index.keys() - scheduler_output.num_scheduled_tokens.keys():
            batch.remove_request(req_id)

        for new in scheduler_output.scheduled_new_reqs:
            state = CachedRequestState(new.req_id, list(new.prompt_token_ids), list(new.output_token_ids),
                                       new.sampling_params, list(new.block_ids), new.num_computed_tokens)
            self.requests[new.req_id] = state
            batch.add_request(state)
            self.prompt_logprobs.add_request(new)

        cached = scheduler_output.scheduled_cached_reqs
        requests, req_id_to_index = self.requests, batch.req_id_to_index
        # Rows already in the batch get their computed-token counts in one numpy write.
        rows: list[int] = []
        rows_num_computed: list[int] = []
        for i, (req_id, new_block_ids, num_computed) in enumerate(
                zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens)):
            state = requests[req_id]
            state.num_computed_tokens = num_computed
            row = req_id_to_index.get(req_id)
            if row is None:
                state.block_ids.extend(new_block_ids)
                row = batch.add_request(state)
            else:
                if new_block_ids:  # most decode steps need no new block
                    state.block_ids.extend(new_block_ids)
                    batch.block_table.append_row(row, new_block_ids)
                rows.append(row)
                rows_num_computed.append(num_computed)
            # Only ranks that did not sample these tokens themselves (PP > 1) are sent them.
            if cached.new_token_ids and cached.new_token_ids[i] and not get_pp_group().is_last_rank:
                for token in cached.new_token_ids[i]:
                    batch.append_token(row, token)
                    state.output_token_ids.append(token)
        if rows:
            batch.num_computed_tokens_cpu[rows] = rows_num_computed
        batch.condense()
