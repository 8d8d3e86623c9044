"""Worker: the device owner. Executors call these methods on every rank, in the same order."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from raylm.common import tracing
from raylm.common.lora_request import LoRARequest
from raylm.common.outputs import GrammarOutput, IntermediateTensors, ModelRunnerOutput, SchedulerOutput
from raylm.common.parallel_layout import NO_DATA_PARALLEL, DataParallelInfo
from raylm.configs import EngineConfig
from raylm.runner.forward_log import ForwardCounts
from raylm.runner.lora.worker_manager import LoRAManager
from raylm.runner.model_runner import ModelRunner
from raylm.runner.parallel_state import (
    get_dp_group,
    get_pp_group,
    init_distributed_environment,
    init_model_parallel,
)

_GIB = 1 << 30


@dataclass(frozen=True)
class MemoryProfile:
    """One worker's memory, in bytes: the budget (gpu_memory_utilization of the device less what other processes
    hold; kv_cache_memory_gib on CPU), what the weights, the activation peak and the CUDA graphs take of it, and what
    is left for the KV cache."""

    rank: int
    budget: int
    weights: int
    peak_activations: int
    cudagraphs: int
    available: int

    def describe(self) -> str:
        def gib(n: int) -> str:
            return f"{n / _GIB:.2f} GiB"

        return (f"rank {self.rank}: budget {gib(self.budget)} - weights {gib(self.weights)} - activation peak "
                f"{gib(self.peak_activations)} - CUDA graphs {gib(self.cudagraphs)} = {gib(self.available)} for the "
                f"KV cache")
logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, local_rank: int = 0,
                 distributed_init_method: str | None = None, num_threads: int | None = None,
                 data_parallel: DataParallelInfo = NO_DATA_PARALLEL) -> None:
        self.config = config
        self.rank = rank  # within the engine; the global rank adds data_parallel.rank * world_size
        self.data_parallel = data_parallel
        self.local_rank = local_rank  # the CUDA device index in this process
        self.distributed_init_method = distributed_init_method
        self.num_threads = num_threads
        self.device: torch.device | None = None
        self.num_steps = 0  # execute_model calls: the timeline's step number, equal to the engine's
        self.model_runner: ModelRunner | None = None

    def init_device(self) -> None:
        if self.config.observability_config.trace_file:
            pp, tp = divmod(self.rank, self.config.parallel_config.tensor_parallel_size)
            tracing.enable(f"rank {self.rank} (TP {tp}, PP {pp})", pid=1 + self.rank)
        resolved = self.config.resolved
        kind = resolved.device
        if kind == "cuda":
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            if self.num_threads:
                torch.set_num_threads(self.num_threads)
        parallel = self.config.parallel_config
        backend = "nccl" if kind == "cuda" else "gloo"
        dp = self.data_parallel
        if resolved.dp_lockstep != (dp.size > 1):  # the DP client hands lock-step engines their DP world, and only them
            raise ValueError(f"dp_lockstep is {resolved.dp_lockstep}, but this worker was given a data-parallel world "
                             f"of {dp.size}: lock-step engines share one world, the others have their own")
        init_distributed_environment(dp.size * parallel.world_size, dp.rank * parallel.world_size + self.rank,
                                     self.distributed_init_method, backend, store_elsewhere=dp.size > 1)
        init_model_parallel(parallel.tensor_parallel_size, parallel.pipeline_parallel_size, dp.size,
                            parallel.enable_expert_parallel, backend=backend)
        torch.manual_seed(self.config.model_config.seed)
        self.model_runner = ModelRunner(self.config, self.device)

    def load_model(self) -> None:
        self._runner().load_model()

    def memory_profile(self) -> MemoryProfile:
        """What this worker can give to the KV cache, and why: on CUDA from a max-size profiling forward (the real
        attention backend and the sampler at full batch) plus the CUDA-graph estimate; on CPU the setting."""
        runner = self._runner()
        assert self.device is not None
        if self.device.type == "cpu":
            budget = int(self.config.cache_config.kv_cache_memory_gib * _GIB)
            return MemoryProfile(self.rank, budget, 0, 0, 0, budget)
        torch.cuda.empty_cache()
        weights = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        scratch_kv = runner.profile_run()
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        used_by_others = total - free - torch.cuda.memory_reserved()
        budget = int(total * self.config.cache_config.gpu_memory_utilization - used_by_others)
        peak = torch.cuda.max_memory_allocated() - weights - scratch_kv
        # The CUDA graphs captured after the KV cache need their own memory beyond the profile run's peak.
        graphs = runner.cudagraph_memory_estimate()
        return MemoryProfile(self.rank, budget, weights, peak, graphs, max(0, budget - weights - peak - graphs))

    def sleep(self, level: int = 1) -> int:
        """Free the KV cache and offload (1) or drop (2) the weights (runner/sleep_mode.py); returns bytes freed."""
        return self._runner().sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._runner().wake_up(tags)

    def is_sleeping(self) -> bool:
        return self._runner().is_sleeping()

    def device_bytes(self) -> dict[str, int]:
        """Bytes the weights and the KV cache hold now (to check that sleep frees them)."""
        return self._runner().device_bytes()

    def kv_cache_bytes_per_block(self) -> int:
        return self._runner().kv_cache_bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._runner().initialize_kv_cache(num_blocks)
        # Graphs read the KV cache at fixed addresses: they are captured once it exists.
        self.compile_or_warm_up_model()

    def get_kv_connector_handshake_metadata(self) -> dict[str, Any] | None:
        """What the engine's scheduler-side KV connector must know of this worker's side (None without one)."""
        connector = self._runner().kv_connector
        return None if connector is None else connector.get_handshake_metadata()

    def shutdown(self) -> None:
        """Stop the KV connector's background work (its threads; a p2p channel's store server and listener), which
        would otherwise outlive an engine shut down in a process that goes on."""
        if self.model_runner is not None and self.model_runner.kv_connector is not None:
            self.model_runner.kv_connector.shutdown()

    def compile_or_warm_up_model(self) -> None:
        """Capture the CUDA graphs (CUDA only; on CPU every forward runs eagerly), logging time and memory."""
        runner = self._runner()
        assert self.device is not None
        if self.device.type != "cuda":
            return
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        start = time.perf_counter()
        num_graphs = runner.capture_model()
        if num_graphs:  # the resolved plan's sizes, every one captured
            torch.cuda.synchronize()
            used = free_before - torch.cuda.mem_get_info()[0]
            logger.info("captured %d CUDA graphs (sizes %s) in %.1f s, %.2f GiB", num_graphs,
                        list(self.config.resolved.cudagraph.capture_sizes), time.perf_counter() - start, used / _GIB)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run this rank's pipeline stage: receive from the previous stage, forward, send to the next. None: the
        step's tokens come from sample_tokens (on the last stage) or from another rank."""
        runner = self._runner()
        pp = get_pp_group()
        tracing.set_step(self.num_steps)
        self.num_steps += 1
        intermediate: IntermediateTensors | None = None
        # Every stage sees the same SchedulerOutput, so all agree on whether anything is sent.
        if not pp.is_first_rank and scheduler_output.total_num_scheduled_tokens > 0:
            with tracing.span("pp_recv"):
                intermediate = IntermediateTensors(pp.recv_tensor_dict())
        with tracing.span("execute_model", num_tokens=scheduler_output.total_num_scheduled_tokens):
            output = runner.execute_model(scheduler_output, intermediate)
        if isinstance(output, IntermediateTensors):
            with tracing.span("pp_send"):
                pp.send_tensor_dict(output.tensors)
            return None
        return output

    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput | None:
        with tracing.span("sample_tokens"):
            return self._runner().sample_tokens(grammar_output)

    def drain_trace(self) -> list[dict[str, Any]]:
        """This process's timeline events since the last drain (common/tracing.py)."""
        return tracing.drain()

    def execute_dummy_batch(self) -> None:
        """A forward with no requests, so that this idle DP rank joins the collectives of the ranks that have work.
        Every pipeline stage runs its own (no stage-to-stage traffic): only the DP and EP groups need the call."""
        with tracing.span("dummy_batch"):
            self._runner().execute_dummy_batch()

    def forward_counts(self) -> tuple[int, int]:
        """(forwards the model ran, all-reduces completed on the DP group's CPU group) so far, counted apart: under
        lock-step DP every forward joins one coordination, so the two are equal on every rank. With record_forwards."""
        return self._forward_counts("forward_counts").forwards, get_dp_group().num_cpu_all_reduces

    def batch_execution_counts(self) -> dict[str, int]:
        """Forwards run padded, and micro-batched, so far (how the batch decisions went). With record_forwards."""
        counts = self._forward_counts("batch_execution_counts")
        return {"padded": counts.padded, "ubatched": counts.ubatched}

    def _forward_counts(self, method: str) -> ForwardCounts:
        forward_log = self._runner().forward_log
        if forward_log is None:
            raise ValueError(f"{method}: forwards are counted only with record_forwards=True (observability_config), "
                             f"which is off here; build the engine with record_forwards=True")
        return forward_log.counts

    def cuda_graph_report(self) -> dict[str, Any]:
        """The sizes FULL graphs are captured for, the graphs captured and replayed per padded size so far, and the
        forwards run since the last call with their graph keys (runner/forward_log.py; with record_forwards)."""
        runner = self._runner()
        assert runner.graphs is not None, "load_model first"
        return runner.graphs.report() | {
            "forwards": runner.forward_log.drain() if runner.forward_log is not None else []}

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read an adapter into this rank's host cache (vLLM's Worker.add_lora); False if it was there."""
        return self._lora_manager().add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._lora_manager().remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self._lora_manager().list_loras()

    def _lora_manager(self) -> LoRAManager:
        manager = self._runner().lora_manager
        if manager is None:
            raise ValueError("LoRA is not enabled (enable_lora=False)")
        return manager

    def has_unfinished_across_dp(self, has_unfinished: bool) -> bool:
        """Whether any lock-step DP engine still has requests: every DP rank asks at the same step, so this collective
        pairs up like the forwards do."""
        return get_dp_group().any_true(has_unfinished)

    def execute_method(self, method: str | Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`method` by name, or a function called as `method(worker, *args, **kwargs)`."""
        if callable(method):
            return method(self, *args, **kwargs)
        return getattr(self, method)(*args, **kwargs)

    def check_health(self) -> bool:
        return self.model_runner is not None

    def _runner(self) -> ModelRunner:
        assert self.model_runner is not None, "init_device first"
        return self.model_runner
