"""ModelRunner: everything one device does in a step.

execute_model: apply the scheduler's diff to the persistent InputBatch, prepare the packed
inputs into persistent buffers, run the forward, keep the logits (ExecuteModelState).
sample_tokens: sample from the kept logits and append the tokens to the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from configs import EngineConfig
from configs.model_info import ModelInfo
from runner import cpu_kernels
from runner.attention import get_attn_backend
from runner.attention.common import CommonAttentionMetadata
from runner.forward_context import set_forward_context
from runner.input_batch import CachedRequestState, InputBatch
from runner.models.loader import load_model
from runner.outputs import IntermediateTensors, ModelRunnerOutput, SchedulerOutput
from runner.parallel_state import get_pp_group
from runner.prompt_logprobs import PromptLogprobsProcessor
from runner.sampler import Sampler
from runner.sampling_inputs import SamplingMetadataBuilder, to_logprobs_lists

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class ExecuteModelState:
    """What execute_model leaves for sample_tokens."""

    scheduler_output: SchedulerOutput
    logits: torch.Tensor  # [num_sampling_reqs, vocab]
    sampling_rows: np.ndarray  # InputBatch rows that sample, in logits order


class ModelRunner:
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

        # Persistent input buffers: allocated once at max size, each step writes a prefix.
        self.input_ids = _Buffer(self.max_num_tokens, torch.int64, device)
        self.positions = _Buffer(self.max_num_tokens, torch.int64, device)
        self.slot_mapping = _Buffer(self.max_num_tokens, torch.int64, device)
        self.query_start_loc = _Buffer(self.max_num_reqs + 1, torch.int32, device)
        self.seq_lens = _Buffer(self.max_num_reqs, torch.int32, device)
        self.block_table = torch.zeros((self.max_num_reqs, self.max_blocks_per_req), dtype=torch.int32, device=device)
        self._arange = np.arange(max(self.max_num_tokens, self.max_num_reqs) + 1, dtype=np.int64)

    # ---- set-up ----------------------------------------------------------------------------

    def load_model(self) -> None:
        parallel = self.config.parallel_config
        pp = get_pp_group()
        self.model = load_model(self.model_info.path, dtype=self.dtype, device=self.device,
                                pp_rank=pp.rank_in_group, pp_size=pp.world_size,
                                partition=parallel.pp_layer_partition)

    def attention_layers(self) -> list[torch.nn.Module]:
        from runner.layers.attention import Attention

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
        for layer in self.attention_layers():
            shape = self.attn_backend.get_kv_cache_shape(num_blocks, self.block_size, layer.num_kv_heads,
                                                         layer.head_size)
            layer.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.kv_caches.append(layer.kv_cache)

    @torch.inference_mode()
    def profile_run(self) -> None:
        """A max-size forward without attention metadata, to measure peak activation memory."""
        assert self.model is not None
        num_tokens = self.max_num_tokens
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(num_tokens, device=self.device) % self.max_model_len
        pp = get_pp_group()
        intermediate = None if pp.is_first_rank else self.model.make_empty_intermediate_tensors(
            num_tokens, self.dtype, self.device)
        with set_forward_context(None, num_tokens):
            hidden = self.model(ids, positions, intermediate)
        if pp.is_last_rank:
            # A full batch of float32 logits is what the sampler adds to the peak.
            self.model.compute_logits(hidden[: self.max_num_reqs]).float().argmax(dim=-1)

    # ---- one step --------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput,
                      intermediate_tensors: IntermediateTensors | None = None,
                      ) -> ModelRunnerOutput | IntermediateTensors | None:
        if self.execute_model_state is not None:
            raise RuntimeError("execute_model called twice without sample_tokens: the previous step's logits "
                               "were never sampled")
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput.empty()
        assert self.model is not None and self.kv_caches, "load_model and initialize_kv_cache come first"

        attn_metadata, num_tokens, sampling_rows, logits_indices = self._prepare_inputs(scheduler_output)
        with set_forward_context(attn_metadata, num_tokens):
            output = self.model(self.input_ids.gpu[:num_tokens], self.positions.gpu[:num_tokens],
                                intermediate_tensors)
        if not get_pp_group().is_last_rank:
            return output
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
        sampler_output = self.sampler(state.logits, self.sampling_metadata.build(batch, rows))
        sampled = sampler_output.sampled_token_ids.tolist()
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

    def _prepare_inputs(self, scheduler_output: SchedulerOutput
                        ) -> tuple[CommonAttentionMetadata, int, np.ndarray, torch.Tensor]:
        batch = self.input_batch
        num_reqs = batch.num_reqs
        num_scheduled_tokens = scheduler_output.num_scheduled_tokens
        num_scheduled = np.array([num_scheduled_tokens[r] for r in batch.req_ids[:num_reqs]], dtype=np.int64)
        cu_num_tokens = num_scheduled.cumsum()
        num_tokens = int(cu_num_tokens[-1])
        assert num_tokens == scheduler_output.total_num_scheduled_tokens

        computed = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        positions = self.positions.np[:num_tokens]
        if num_tokens == num_reqs:  # one token per request (decode): token i belongs to row i
            req_indices = self._arange[:num_reqs]
            positions[:] = computed
        else:
            req_indices = self._arange[:num_reqs].repeat(num_scheduled)
            offsets = self._arange[:num_tokens] - (cu_num_tokens - num_scheduled).repeat(num_scheduled)
            np.add(computed[req_indices], offsets, out=positions)

        token_index = positions + req_indices * batch.max_model_len
        batch.token_ids_cpu.ravel().take(token_index, out=self.input_ids.np[:num_tokens])
        block_index = req_indices * self.max_blocks_per_req + positions // self.block_size
        block_numbers = batch.block_table.table.ravel()[block_index].astype(np.int64)
        np.add(block_numbers * self.block_size, positions % self.block_size, out=self.slot_mapping.np[:num_tokens])

        query_start_loc = self.query_start_loc.np
        query_start_loc[0] = 0
        query_start_loc[1 : num_reqs + 1] = cu_num_tokens
        seq_lens = computed + num_scheduled
        self.seq_lens.np[:num_reqs] = seq_lens
        # Partial prefills do not sample: their last scheduled token is not the last known one.
        sampling_rows = np.flatnonzero(seq_lens >= batch.num_tokens[:num_reqs])
        logits_indices = torch.from_numpy(cu_num_tokens[sampling_rows] - 1).to(self.device, non_blocking=True)

        for buffer in (self.input_ids, self.positions, self.slot_mapping):
            buffer.copy_to_device(num_tokens)
        self.query_start_loc.copy_to_device(num_reqs + 1)
        self.seq_lens.copy_to_device(num_reqs)
        max_blocks = int(batch.block_table.num_blocks[:num_reqs].max())
        self.block_table[:num_reqs, :max_blocks].copy_(
            torch.from_numpy(batch.block_table.table[:num_reqs, :max_blocks]), non_blocking=True)

        metadata = CommonAttentionMetadata(
            query_start_loc=self.query_start_loc.gpu[: num_reqs + 1],
            query_start_loc_cpu=self.query_start_loc.cpu[: num_reqs + 1],
            seq_lens=self.seq_lens.gpu[:num_reqs],
            seq_lens_cpu=self.seq_lens.cpu[:num_reqs],
            block_table=self.block_table[:num_reqs, :max_blocks],
            slot_mapping=self.slot_mapping.gpu[:num_tokens],
            num_reqs=num_reqs,
            num_actual_tokens=num_tokens,
            max_query_len=int(num_scheduled.max()),
            max_seq_len=int(seq_lens.max()),
        )
        return self.attn_backend.build(metadata), num_tokens, sampling_rows, logits_indices


class _Buffer:
    """A CPU tensor with a numpy view, and its device twin (the same tensor on CPU)."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.cpu = torch.zeros(size, dtype=dtype, pin_memory=pin)
        self.np = self.cpu.numpy()
        self.gpu = self.cpu if device.type == "cpu" else torch.zeros(size, dtype=dtype, device=device)

    def copy_to_device(self, n: int) -> None:
        if self.gpu is not self.cpu:
            self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)
