"""ModelRunner: everything one device does in a step, built from parts.

execute_model: apply the scheduler's diff to the persistent InputBatch, pack the step into the persistent input
buffers, take the batch decision, run the forward, keep the logits (ExecuteModelState).
sample_tokens: sample from the kept logits and append the tokens to the batch.

The parts: InputBatch (the requests' rows), InputBuffers (the packed step), BatchPlanner (the batch decision: graph
mode, padding, micro-batches, DP coordination), DecodeGraphs (FULL CUDA graphs), ProfileRun (the memory profile),
SleepMode, the Sampler and PromptLogprobsProcessor. Every forward of a step, a dummy batch or the profile run goes
through `_run_forward`, which takes the batch decision first, so under lock-step data parallel no rank can skip a
collective the others wait in; graph capture (DecodeGraphs.forward: every rank the same sizes in the same order) and
the draft model (refused under lock-step DP) call their models themselves. Over 300 lines: the two halves of a step
share the kept state (ExecuteModelState) and every part, and read best side by side.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from raylm.common import tracing
from raylm.common.kv_transfer import KVConnectorOutput
from raylm.common.object_storage import checkpoint_here
from raylm.common.outputs import GrammarOutput, IntermediateTensors, ModelRunnerOutput, SchedulerOutput
from raylm.configs import EngineConfig
from raylm.configs.kv_cache_groups import kv_cache_groups, sliding_group_window
from raylm.runner import cpu_kernels
from raylm.runner.attention import get_attn_backend
from raylm.runner.attention.common import CommonAttentionMetadata
from raylm.runner.batch_planner import BatchPlanner, log_batch_execution
from raylm.runner.cuda_graph import DecodeGraphs
from raylm.runner.cudagraph_dispatcher import CudagraphDispatcher
from raylm.runner.forward_context import set_forward_context
from raylm.runner.forward_log import ForwardLog
from raylm.runner.host_sync import to_host
from raylm.runner.input_batch import InputBatch
from raylm.runner.input_buffers import InputBuffers
from raylm.runner.kv_transfer.base import KVConnectorBase
from raylm.runner.kv_transfer.model_runner_hooks import (
    create_worker_connector,
    kv_connector_no_forward,
    kv_connector_step,
)
from raylm.runner.layers.attention import Attention
from raylm.runner.layers.mla_attention import kv_cache_shape
from raylm.runner.lora.worker_manager import LoRAManager
from raylm.runner.models.cpu_layer_stack import stack_layers
from raylm.runner.models.llama import LlamaForCausalLM
from raylm.runner.models.loader import load_model, reload_weights
from raylm.runner.parallel_state import get_dp_group, get_pp_group
from raylm.runner.pooler import Pooler
from raylm.runner.profile_run import ProfileRun
from raylm.runner.prompt_logprobs import PromptLogprobsProcessor
from raylm.runner.request_states import RequestStates
from raylm.runner.sampler import Sampler
from raylm.runner.sampling_inputs import SamplingMetadataBuilder, to_logprobs_lists
from raylm.runner.sleep_mode import SleepMode
from raylm.runner.spec_decode.metadata import SpecDecodeMetadata
from raylm.runner.spec_decode.spec_decoder import SpecDecoder
from raylm.runner.structured_output import apply_grammar_bitmask
from raylm.runner.ubatch_splitting import create_ubatch_slices
from raylm.runner.ubatching import forward_in_ubatches

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class ExecuteModelState:
    """What execute_model leaves for sample_tokens."""

    scheduler_output: SchedulerOutput
    logits: torch.Tensor  # [num_sampling_reqs, vocab]
    sampling_rows: np.ndarray  # InputBatch rows that sample, in logits order
    spec_decode_metadata: SpecDecodeMetadata | None = None  # the drafts' logits rows, when any request has drafts
    hidden_states: torch.Tensor | None = None  # the forward's output (speculative decoding's proposer may read it)
    kv_connector_output: KVConnectorOutput | None = None
    pooler_output: dict[str, torch.Tensor] | None = None  # pooling requests done this step (on the device)


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        """`config` resolved (its device type is `device`'s; `device` names the index of this worker's)."""
        resolved = config.resolved
        model_info = resolved.model_info
        assert device.type == resolved.device, (device, resolved.device)
        self.config, self.model_info, self.device = config, model_info, device
        self.dtype = _TORCH_DTYPES[resolved.dtype]
        self.block_size = config.cache_config.block_size
        self.max_model_len = config.model_config.max_model_len
        assert self.max_model_len is not None
        self.max_num_reqs = config.scheduler_config.max_num_seqs
        max_blocks_per_req = -(-self.max_model_len // self.block_size)
        cpu_kernels.set_enabled(config.compilation_config.custom_ops != "none")

        self.input_batch = InputBatch(self.max_num_reqs, self.max_model_len, max_blocks_per_req, model_info.vocab_size,
                                      sliding_group=sliding_group_window(config) is not None)
        self.uniform_decode_query_len = resolved.uniform_decode_query_len
        self.buffers = InputBuffers(config.scheduler_config.max_num_batched_tokens, self.max_num_reqs,
                                    max_blocks_per_req, self.block_size, device, self.uniform_decode_query_len)
        self.attn_backend = get_attn_backend(resolved.attention_backend)
        self.sampler = Sampler()
        self.sampling_metadata = SamplingMetadataBuilder(model_info.eos_token_ids, device)
        self.prompt_logprobs = PromptLogprobsProcessor(self.max_num_reqs)
        self.pooler = Pooler()
        self.profile = ProfileRun(self.buffers, self.attn_backend, self.sampler, self.dtype, self.max_model_len)
        # The graph key of recent forwards (scripts/gpu_proof.py) and the forwards' counts (tests): a diagnostic, kept
        # only when asked for, so that without it the hot path records and counts nothing.
        self.forward_log = ForwardLog() if config.observability_config.record_forwards else None
        self.log_batch_execution = config.observability_config.log_batch_execution
        # Built by load_model, which knows the process groups (a runner is built before, and tested without, them).
        self.model: LlamaForCausalLM | None = None
        self.planner: BatchPlanner | None = None
        self.graphs: DecodeGraphs | None = None
        self.sleep_mode: SleepMode | None = None  # once the KV cache exists
        self.lora_manager: LoRAManager | None = None  # with enable_lora, once the model is loaded
        self.kv_caches: list[torch.Tensor] = []
        self.group_kv_caches: list[torch.Tensor] = []  # one layer's cache of each KV cache group
        self.kv_connector: KVConnectorBase | None = None  # the worker side of a kv_connector, once the cache exists
        self.execute_model_state: ExecuteModelState | None = None
        self.spec_decoder = (None if config.speculative_config is None else
                             SpecDecoder(config, self.attn_backend, self.dtype, device))
        self.states = RequestStates(self.input_batch, self.prompt_logprobs, self.spec_decoder)

    # ---- set-up ----------------------------------------------------------------------------

    def load_model(self) -> None:
        pp = get_pp_group()
        assert self.model_info.hf_config is not None, "read_model_info keeps the checkpoint's config"
        # An object-storage checkpoint loads from this node's copy, fetched here once if the engine's node is another.
        path = checkpoint_here(self.model_info.path, self.model_info.source, "model")
        self.model = load_model(path, self.model_info.hf_config, dtype=self.dtype, device=self.device,
                                pp_rank=pp.rank_in_group, pp_size=pp.world_size,
                                partition=self.config.parallel_config.pp_layer_partition,
                                quantization=self.config.resolved.quantization)
        if self.config.lora_config.enable_lora:
            self.lora_manager = LoRAManager(self.model, self.config.lora_config, self.buffers.max_num_tokens,
                                            self.dtype, self.device)
        if not self.config.compilation_config.enforce_eager:
            stack_layers(self.model)
        dispatcher = CudagraphDispatcher(self.config.resolved.cudagraph)
        self.planner = BatchPlanner(dispatcher, self.config.parallel_config, get_dp_group(),
                                    self.config.resolved.dp_lockstep)
        self.graphs = DecodeGraphs(dispatcher, self.attn_backend, self.buffers, self.device)
        if self.spec_decoder is not None:
            self.spec_decoder.proposer.load_model(self.model)

    def attention_layers(self) -> list[Attention]:
        assert self.model is not None, "load_model first"
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    def kv_cache_layers(self) -> list[Attention]:
        """Every layer that gets KV cache: the model's, and a speculative proposer's (in the same blocks)."""
        proposer = [] if self.spec_decoder is None else self.spec_decoder.proposer.attention_layers()
        return self.attention_layers() + proposer

    def kv_cache_bytes_per_block(self) -> int:
        element_size = torch.empty((), dtype=self.dtype).element_size()
        total = 0
        for layer in self.kv_cache_layers():
            shape = kv_cache_shape(layer, self.attn_backend, 1, self.block_size)
            total += int(np.prod(shape)) * element_size
        return total

    def initialize_kv_cache(self, num_blocks: int) -> None:
        # A pool smaller than max_model_len is allowed: the scheduler rejects each request that could never fit.
        assert self.model is not None and self.graphs is not None, "load_model first"
        # One block past the scheduler's: inside a graph, padded rows write there (no per-row branch is possible).
        extra = 1 if self.graphs.enabled else 0
        groups = kv_cache_groups(self.config, num_blocks)  # the scheduler splits the pool the same way
        global_blocks = num_blocks if groups is None else groups.num_blocks
        self.graphs.scratch_slot = global_blocks * self.block_size if extra else -1
        self.graphs.sliding_scratch_slot = groups.num_sliding_blocks * self.block_size if extra and groups else -1
        self.kv_caches = []
        for layer in self.kv_cache_layers():
            sliding = groups is not None and layer.sliding_window is not None
            layer_blocks = groups.num_sliding_blocks if groups is not None and sliding else global_blocks
            shape = kv_cache_shape(layer, self.attn_backend, layer_blocks + extra, self.block_size)
            layer.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.kv_caches.append(layer.kv_cache)
        self.group_kv_caches = list({cache.shape: cache for cache in self.kv_caches}.values())
        self.kv_connector = create_worker_connector(
            self.config, {layer.layer_idx: layer.kv_cache for layer in self.attention_layers()})
        model = self.model
        self.sleep_mode = SleepMode(model, self.kv_caches, lambda: reload_weights(
            model, checkpoint_here(self.model_info.path, self.model_info.source, "model")))

    # ---- one step --------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput,
                      intermediate_tensors: IntermediateTensors | None = None,
                      ) -> ModelRunnerOutput | IntermediateTensors | None:
        if self.execute_model_state is not None:
            raise RuntimeError("execute_model called twice without sample_tokens: the previous step's logits "
                               "were never sampled")
        with tracing.span("update_states"):
            self.pooler.update(scheduler_output)
            self.states.update(scheduler_output, get_pp_group().is_last_rank)
        if scheduler_output.total_num_scheduled_tokens == 0:
            if self.planner is not None and self.planner.coordinates:
                self.execute_dummy_batch()  # the other DP ranks' forwards wait for this one in their collectives
            empty = ModelRunnerOutput.empty()
            if self.kv_connector is not None:
                empty.kv_connector_output = kv_connector_no_forward(self.kv_connector, scheduler_output)
            return empty
        assert self.model is not None and self.kv_caches, "load_model and initialize_kv_cache come first"
        pp = get_pp_group()
        assert pp.is_first_rank or intermediate_tensors is not None, "a later pipeline stage needs the tensors sent"

        with tracing.span("prepare_inputs"):
            drafts = (None if self.spec_decoder is None
                      else self.spec_decoder.prepare_drafts(scheduler_output, self.input_batch))
            inputs = self.buffers.prepare(scheduler_output, self.input_batch, drafts)
            has_lora = self.lora_manager is not None and self.lora_manager.prepare(
                self.input_batch.request_lora_mapping[:inputs.num_reqs], self.input_batch.lora_id_to_request,
                np.diff(self.buffers.query_start_loc.np[:inputs.num_reqs + 1]))
        with kv_connector_step(self.kv_connector, scheduler_output) as kv_connector_output:
            output = self._run_forward(inputs.num_tokens, inputs.num_reqs, inputs.uniform_decode, inputs.common,
                                       intermediate_tensors, has_lora, inputs.sliding_common)
        if not pp.is_last_rank:
            assert isinstance(output, IntermediateTensors)
            return output
        assert isinstance(output, torch.Tensor)
        sampling_rows, logits_indices = inputs.sampling_rows, inputs.logits_indices
        with tracing.span("pool"):
            pooled, samples = self.pooler.pool(output, self.input_batch, self.buffers.query_start_loc.np,
                                               sampling_rows)
        if pooled:  # rows that finished a pooling request's prompt sample nothing (never with drafts: refused)
            assert inputs.spec_decode_metadata is None
            sampling_rows = sampling_rows[samples]
            logits_indices = logits_indices[torch.from_numpy(samples).to(logits_indices.device)]
        # Padding rows (if any) come after the real tokens: logits_indices never reach them.
        with tracing.span("compute_logits"):
            logits = self.model.compute_logits(output[logits_indices]).float()
            self.prompt_logprobs.compute(output, self.input_batch, self.buffers.query_start_loc.np,
                                         self.model.compute_logits)
        self.execute_model_state = ExecuteModelState(scheduler_output, logits, sampling_rows,
                                                     inputs.spec_decode_metadata, output, kv_connector_output, pooled)
        return None

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput | None:
        state = self.execute_model_state
        if state is None:
            return None  # non-last pipeline stage, or execute_model already answered
        self.execute_model_state = None
        batch, rows, spec_metadata = self.input_batch, state.sampling_rows, state.spec_decode_metadata
        if grammar_output is not None:  # with drafts: every logits row of a constrained request, drafts' and bonus
            apply_grammar_bitmask(state.logits, grammar_output, [batch.req_ids[row] for row in rows.tolist()],
                                  None if spec_metadata is None else spec_metadata.num_draft_tokens)
        if self.spec_decoder is not None:
            with tracing.span("sample"):
                spec = self.spec_decoder.sample(state.logits, spec_metadata, rows, batch,
                                                self.sampling_metadata.build(batch, rows), state.hidden_states)
            return ModelRunnerOutput(batch.live_req_ids, spec.sampled_token_ids, spec.logprobs,
                                     self.prompt_logprobs.pop_completed(), spec.spec_token_ids,
                                     kv_connector_output=state.kv_connector_output)
        with tracing.span("sample"):
            sampler_output = self.sampler(state.logits, self.sampling_metadata.build(batch, rows))
            sampled = to_host(sampler_output.sampled_token_ids)[0].tolist()  # the step's one host wait
        batch.append_sampled(rows, sampled)

        req_ids = batch.live_req_ids
        if len(sampled) == len(req_ids):  # every row samples, in row order
            sampled_token_ids = [[token] for token in sampled]
        else:
            sampled_token_ids = [[] for _ in req_ids]
            for row, token in zip(rows.tolist(), sampled):
                sampled_token_ids[row] = [token]
        logprobs = to_logprobs_lists(batch, rows, sampler_output.logprobs_tensors)
        pooler_output = {req_id: vector.cpu() for req_id, vector in (state.pooler_output or {}).items()}
        return ModelRunnerOutput(list(req_ids), sampled_token_ids, logprobs, self.prompt_logprobs.pop_completed(),
                                 kv_connector_output=state.kv_connector_output, pooler_output=pooler_output)

    @torch.inference_mode()
    def execute_dummy_batch(self) -> None:
        """A forward of one zero token at position 0, without attention metadata (the KV cache untouched), so that an
        idle DP rank joins the collectives of the ranks with work. Nothing is sampled; the InputBatch is untouched."""
        self.buffers.pad(0, 1)  # a dummy batch is padding only
        self._run_forward(1, 1, True, None, None)

    # ---- the forward -----------------------------------------------------------------------

    def _run_forward(self, num_tokens: int, num_reqs: int, uniform_decode: bool,
                     common: CommonAttentionMetadata | None,
                     intermediate_tensors: IntermediateTensors | None,
                     has_lora: bool = False, sliding_common: CommonAttentionMetadata | None = None,
                     ) -> torch.Tensor | IntermediateTensors:
        """The target model's forward in a step, a dummy batch or the profile run, always after the batch decision
        (so after the DP coordination). The first `num_tokens` input rows are written; padding rows are filled here.
        `common` None: a dummy batch. A later pipeline stage without received tensors (dummy and profile runs: no
        stage-to-stage traffic) runs on zeros."""
        model, planner, graphs, buffers = self.model, self.planner, self.graphs, self.buffers
        assert model is not None and planner is not None and graphs is not None, "load_model first"
        assert not self.is_sleeping(), "a forward while the weights or the KV cache are freed (sleep mode)"
        with tracing.span("batch_decision", dp_sync=planner.coordinates):
            descriptor = planner.determine_batch_execution_and_padding(num_tokens, num_reqs, uniform_decode, has_lora)
        n = descriptor.num_tokens_padded
        if n > num_tokens:
            buffers.pad(num_tokens, n)
        if intermediate_tensors is None and not get_pp_group().is_first_rank:
            intermediate_tensors = model.make_empty_intermediate_tensors(n, self.dtype, self.device)
        # The previous stage took the same decision for the same batch, so it sent n rows.
        assert intermediate_tensors is None or intermediate_tensors["hidden_states"].shape[0] == n
        ubatch_slices = None
        if descriptor.should_ubatch:
            cu_num_tokens = None if common is None else buffers.query_start_loc.np[:num_reqs + 1]
            ubatch_slices = create_ubatch_slices(cu_num_tokens, num_tokens, n)
        if self.log_batch_execution:
            log_batch_execution(descriptor, ubatch_slices)
        # The profile run has no KV cache yet, and no graph can have been captured before it.
        replay = common is not None and bool(self.kv_caches) and graphs.can_replay(descriptor, common,
                                                                                    self.group_kv_caches)
        if self.forward_log is not None:
            self.forward_log.record(descriptor, common is not None and graphs.should_replay(descriptor), replay)
        if ubatch_slices is not None:
            with tracing.span("forward", num_tokens=n, ubatches=len(ubatch_slices)):
                return forward_in_ubatches(model, buffers, self.attn_backend, descriptor, ubatch_slices, common,
                                           intermediate_tensors)
        if replay:
            assert uniform_decode and num_reqs == num_tokens, "FULL graphs are captured for uniform decode batches"
            with tracing.span("forward", num_tokens=n, cuda_graph=True):
                return graphs.replay(num_reqs, n)
        attn_metadata = None if common is None else self.attn_backend.build(common)
        sliding_metadata = None if sliding_common is None else self.attn_backend.build(sliding_common)
        with (set_forward_context(attn_metadata, n, descriptor, self.kv_connector, sliding_metadata),
              tracing.span("forward", num_tokens=n)):
            return model(buffers.input_ids.gpu[:n], buffers.positions.gpu[:n], intermediate_tensors)

    # ---- memory: profile, graphs, sleep ----------------------------------------------------

    def profile_run(self) -> int:
        """The max-size forward and sampler step before the KV cache exists; returns the scratch KV bytes it held."""
        assert self.model is not None, "load_model first"
        return self.profile.run(self.model, self.attention_layers(), self._run_forward, get_pp_group().is_last_rank)

    def capture_model(self) -> int:
        assert self.model is not None and self.graphs is not None, "load_model first"
        return self.graphs.capture(self.model)

    def cudagraph_memory_estimate(self) -> int:
        assert self.graphs is not None, "load_model first"
        max_seq_len = self.buffers.max_blocks_per_req * self.block_size  # the block table's whole width
        return self.graphs.memory_estimate(self.attention_layers()[0], max_seq_len, self.dtype)

    def sleep(self, level: int = 1) -> int:
        assert self.sleep_mode is not None and self.graphs is not None, "initialize_kv_cache first"
        self.graphs.drop()  # its graphs read the storages at their present addresses
        return self.sleep_mode.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        assert self.sleep_mode is not None, "initialize_kv_cache first"
        self.sleep_mode.wake_up(tags)
        if not self.sleep_mode.is_sleeping() and self.device.type == "cuda":
            self.capture_model()

    def is_sleeping(self) -> bool:
        return self.sleep_mode is not None and self.sleep_mode.is_sleeping()

    def device_bytes(self) -> dict[str, int]:
        assert self.sleep_mode is not None, "initialize_kv_cache first"
        return self.sleep_mode.device_bytes()
