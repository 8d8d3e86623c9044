"""The Executor interface the engine core drives: a step is execute_model, then sample_tokens, both futures."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from raylm.common.outputs import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from raylm.common.parallel_layout import NO_DATA_PARALLEL, DataParallelInfo
from raylm.configs import EngineConfig
from raylm.executor.ray_cluster import initialize_ray_cluster
from raylm.worker.worker import MemoryProfile


class Executor(ABC):
    def __init__(self, config: EngineConfig, data_parallel: DataParallelInfo = NO_DATA_PARALLEL) -> None:
        self.config = config
        self.model_info = config.model_info
        self.data_parallel = data_parallel
        if config.kv_transfer_config.kv_connector is not None:  # the connectors' stores and transfers are Ray's
            initialize_ray_cluster(config.resolved.num_ray_bundles)
        self._init_executor()

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        backend = config.resolved.executor_backend
        if backend == "uni":
            from raylm.executor.uniproc import UniProcExecutor

            return UniProcExecutor
        assert backend == "ray", f"unknown executor backend {backend!r}"
        from raylm.executor.ray_executor import RayExecutor

        return RayExecutor

    @abstractmethod
    def _init_executor(self) -> None: ...

    @abstractmethod
    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call `method` (a Worker method name, or a function called as `method(worker, *args, **kwargs)`) on every
        worker; results in rank order."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput | None]:
        """Start the forward; the future holds None when sample_tokens must follow."""

    @abstractmethod
    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> Future[ModelRunnerOutput | None]:
        """Sample the step execute_model started, under the step's grammar bitmask (None: no constrained request);
        the future holds None when execute_model already answered."""

    @abstractmethod
    def execute_dummy_batch(self) -> Future[None]:
        """A forward without requests on every worker: an idle lock-step DP engine's share of the collectives."""

    @abstractmethod
    def check_health(self) -> None:
        """Raise if any worker is dead."""

    @abstractmethod
    def shutdown(self) -> None: ...

    def determine_num_blocks(self) -> int:
        """KV blocks every worker can hold: the minimum across workers."""
        override = self.config.cache_config.num_gpu_blocks_override
        if override is not None:
            return override
        profiles: list[MemoryProfile] = self.collective_rpc("memory_profile")
        per_block = self.collective_rpc("kv_cache_bytes_per_block")
        blocks = [profile.available // size for profile, size in zip(profiles, per_block)]
        num_blocks = min(blocks)
        block_size = self.config.cache_config.block_size
        max_model_len = self.config.model_config.max_model_len
        assert max_model_len is not None
        needed = -(-max_model_len // block_size)  # one request of max_model_len tokens
        if num_blocks < needed:
            worst = blocks.index(num_blocks)
            raise ValueError(
                f"the KV cache has room for {num_blocks} blocks of {block_size} tokens "
                f"({per_block[worst]} bytes each), but one request of max_model_len={max_model_len} "
                f"tokens needs {needed}: {profiles[worst].describe()}. Raise gpu_memory_utilization (GPU) or "
                f"kv_cache_memory_gib (CPU), lower max_model_len, or shard the model over more devices "
                f"(tensor_parallel_size / pipeline_parallel_size)")
        return num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))
