"""The one place where an engine's config is resolved: every `auto` setting filled in and every derived fact decided,
once, logged once, frozen; every layer below reads the fields and decides nothing again.

It runs where the engine runs: in the LLMEngine's process (an `LLM`, the CLI, a Serve replica), so a Serve replica on
a GPU cluster decides from what it holds itself, not from what the process that built the app saw.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from raylm.cluster.default_model import resolve_model
from raylm.common.logger import show_info
from raylm.configs import EngineConfig, ModelConfig, ParallelConfig
from raylm.configs.engine_config import ResolvedConfig
from raylm.configs.model_info import (
    ModelInfo,
    read_model_info,
    resolve_dtype,
    resolve_max_model_len,
    resolve_quantization,
)
from raylm.executor.ray_cluster import cluster_has_gpus, initialize_ray_cluster, ray_reachable
from raylm.runner.attention import choose_attn_backend
from raylm.runner.cudagraph_dispatcher import resolve_cudagraph_mode
from raylm.runner.models.registry import check_architecture

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def decide_device(model_config: ModelConfig, parallel_config: ParallelConfig) -> str:
    """"cpu" or "cuda". "auto": CUDA when this process sees a GPU; otherwise, where the engine runs on Ray (its workers
    or DP engines are actors, or this process is in a Ray cluster: a replica, a job), CUDA when the cluster has GPUs,
    connecting to Ray first; else CPU."""
    if model_config.device != "auto":
        return model_config.device
    if torch.cuda.is_available():
        return "cuda"
    if _needs_ray(parallel_config) or ray_reachable():
        initialize_ray_cluster(_num_ray_bundles(parallel_config))
        return "cuda" if cluster_has_gpus() else "cpu"
    return "cpu"


def resolve_engine_config(config: EngineConfig) -> EngineConfig:
    """`config` with every decision made (see the module docstring); a resolved config comes back as it is."""
    if config.resolved is not None:
        return config
    model_config, parallel = resolve_model(config.model_config), config.parallel_config
    assert model_config.model is not None
    # The checkpoint first: what it cannot run fails here, before any connection to Ray or placement.
    model_info = read_model_info(model_config.model)
    check_architecture(model_info.architecture)
    max_model_len = resolve_max_model_len(model_config, model_info)
    quantization = resolve_quantization(model_config, model_info)
    dp_lockstep = model_info.is_moe and parallel.enable_expert_parallel and parallel.data_parallel_size > 1
    _check_expert_parallel(model_info, parallel, dp_lockstep)

    device = decide_device(model_config, parallel)
    dtype = resolve_dtype(model_config, model_info, device)
    executor_backend = _executor_backend(parallel, device)
    scheduler = config.scheduler_config
    if dp_lockstep and scheduler.async_scheduling:
        raise ValueError("async_scheduling is not supported with expert-parallel data parallel (MoE with "
                         "enable_expert_parallel and data_parallel_size > 1): its engines step in lock-step")
    pp = parallel.pipeline_parallel_size
    # Under PP, stage 0 learns a request's sampled token only from the next SchedulerOutput, so the scheduler must
    # not plan ahead with placeholders; async scheduling still deepens the batch queue by one step.
    max_concurrent_batches = 1 if dp_lockstep else pp + int(scheduler.async_scheduling)
    compilation = config.compilation_config
    attention_backend = choose_attn_backend(config.cache_config.attention_backend, device, _TORCH_DTYPES[dtype],
                                            config.cache_config.block_size, custom_ops=compilation.custom_ops != "none")

    resolved = dataclasses.replace(
        config,
        model_config=model_config.model_copy(update={
            "device": device, "dtype": dtype, "max_model_len": max_model_len, "quantization": quantization,
            "tokenizer": model_config.tokenizer or model_config.model}),
        cache_config=config.cache_config.model_copy(update={"attention_backend": attention_backend}),
        parallel_config=parallel.model_copy(update={"distributed_executor_backend": executor_backend}),
        scheduler_config=scheduler.model_copy(update={"async_scheduling": scheduler.async_scheduling and pp == 1}),
        compilation_config=compilation.model_copy(update={
            "cudagraph_mode": resolve_cudagraph_mode(compilation, device)}),
        resolved=ResolvedConfig(model_info, _num_ray_bundles(parallel), dp_lockstep,
                                max_concurrent_batches),
    )
    show_info(logger)
    logger.info("engine config: model %s (%s), device %s, dtype %s, quantization %s, attention %s, executor %s%s, "
                "cudagraph_mode %s, max_model_len %d, %d step(s) in flight", model_config.served_model_name,
                model_info.architecture, device, dtype, quantization, attention_backend, executor_backend,
                ", lock-step DP" if dp_lockstep else "", resolved.compilation_config.cudagraph_mode,
                max_model_len, max_concurrent_batches)
    return resolved


def _needs_ray(parallel: ParallelConfig) -> bool:
    return (parallel.world_size > 1 or parallel.data_parallel_size > 1
            or parallel.distributed_executor_backend == "ray")


def _num_ray_bundles(parallel: ParallelConfig) -> int:
    """Each DP engine's placement group: its own bundle and one per worker."""
    return parallel.data_parallel_size * (parallel.world_size + 1)


def _executor_backend(parallel: ParallelConfig, device: str) -> str:
    """"uni" (the worker in the engine's process) or "ray" (worker actors). An engine alone (no DP) that must run on
    CUDA from a process without a GPU (a Serve replica given none, a job's CPU head) puts its worker on Ray."""
    backend = parallel.distributed_executor_backend
    world_size = parallel.world_size
    no_local_gpu = device == "cuda" and not torch.cuda.is_available() and parallel.data_parallel_size == 1
    if backend == "uni":
        if world_size != 1:
            raise ValueError(f"distributed_executor_backend 'uni' runs one device; tensor_parallel_size x "
                             f"pipeline_parallel_size is {world_size}: use 'ray'")
        if no_local_gpu:
            raise ValueError("distributed_executor_backend 'uni' runs the worker in this process, which has no GPU, "
                             "but the device is cuda: use 'ray' (a worker actor on a GPU) or device 'cpu'")
        return "uni"
    if backend == "ray" or world_size > 1 or no_local_gpu:
        return "ray"
    return "uni"


def _check_expert_parallel(model_info: ModelInfo, parallel: ParallelConfig, dp_lockstep: bool) -> None:
    """Reject expert-parallel settings this checkpoint cannot honour."""
    if not parallel.enable_expert_parallel:
        return
    if not model_info.is_moe:
        raise ValueError(f"enable_expert_parallel: {model_info.architecture} has no experts (not a MoE model)")
    ep_size = parallel.tensor_parallel_size * (parallel.data_parallel_size if dp_lockstep else 1)
    if model_info.num_experts % ep_size:
        raise ValueError(f"enable_expert_parallel: {model_info.num_experts} experts cannot be split evenly over "
                         f"{ep_size} expert-parallel ranks (data_parallel_size x tensor_parallel_size)")
