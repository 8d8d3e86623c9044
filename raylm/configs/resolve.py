"""Resolution: the settings, the checkpoint's facts (ModelInfo) and the environment's (EnvironmentFacts) in, every
decision out, once, as the frozen ResolvedConfig every layer reads. A pure function: no I/O, no Ray, no torch. The
engine's floor reads the checkpoint and gathers the facts (cluster/engine/config_resolver.py); Ray is started by
whoever places workers (the executor, the DP client), never by resolving. docs/architecture.md lists each decision,
the function here that makes it, and its readers.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from raylm.configs.attention_backends import attention_features, choose_attention_backend
from raylm.configs.bundles import EngineBundles, device_bundle, engine_bundles
from raylm.configs.cudagraph_plan import plan_cuda_graphs, why_no_full_graphs
from raylm.configs.engine_config import EngineConfig, ParallelConfig, ResolvedConfig
from raylm.configs.environment import EnvironmentFacts
from raylm.configs.kv_identity import KVIdentity
from raylm.configs.lora import resolve_lora_config
from raylm.configs.model_info import ModelInfo, resolve_dtype, resolve_max_model_len, resolve_quantization
from raylm.configs.parallel_checks import check_parallel_layout
from raylm.configs.pooler_config import resolve_pooler_config
from raylm.configs.resolve_sections import (
    check_architecture,
    resolve_kv_transfer,
    resolve_routing_policy,
    resolve_speculative,
    structured_outputs_backends,
    uniform_decode_query_len,
)
from raylm.configs.scheduler_defaults import UsageContext, resolve_scheduler_config


@dataclass(frozen=True)
class Deployment:
    """The decisions that need no checkpoint: where the engine runs and how it is placed and routed. The Serve
    builder takes them for a replica's resources (cluster/serve/app.py); resolve_config for the engine."""

    device: str
    executor_backend: str
    bundle_layout: EngineBundles
    num_ray_bundles: int
    routing_policy: str


def resolve_deployment(config: EngineConfig, env: EnvironmentFacts) -> Deployment:
    parallel = config.parallel_config
    device = decide_device(config, env)
    executor_backend = decide_executor_backend(parallel, device, env)
    num_ray_bundles = parallel.data_parallel_size * (parallel.world_size + 1)  # each engine's bundle and its workers'
    if executor_backend == "uni":  # the worker computes in the engine's process: the engine's bundle is the device
        layout = EngineBundles(device_bundle(device), ())
    else:
        layout = engine_bundles(parallel, device, env.nodes_for(num_ray_bundles), parallel.data_parallel_size)
    return Deployment(device, executor_backend, layout, num_ray_bundles, resolve_routing_policy(config))


def decide_device(config: EngineConfig, env: EnvironmentFacts) -> str:
    """"cpu" or "cuda". "auto": CUDA when this process sees a GPU, or when it is in a Ray cluster that has GPUs (a
    Serve replica given none, a job's CPU head: its workers go to GPU actors); else CPU."""
    device = config.model_config.device
    if device != "auto":
        return device
    return "cuda" if env.cuda_devices or env.cluster_gpus else "cpu"


def decide_executor_backend(parallel: ParallelConfig, device: str, env: EnvironmentFacts) -> str:
    """"uni" (the worker in the engine's process) or "ray" (worker actors). An engine alone (no DP) that must run on
    CUDA from a process without a GPU (a Serve replica given none, a job's CPU head) puts its worker on Ray."""
    backend = parallel.distributed_executor_backend
    world_size = parallel.world_size
    no_local_gpu = device == "cuda" and not env.cuda_devices and parallel.data_parallel_size == 1
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


def resolve_config(config: EngineConfig, model_info: ModelInfo, env: EnvironmentFacts,
                   draft_model_info: ModelInfo | None = None,
                   usage_context: UsageContext = "engine_context") -> EngineConfig:
    """`config` (its model a local checkpoint, whose facts are `model_info`; a draft checkpoint's are
    `draft_model_info`) with every decision made: `resolution` set, and the sections' `auto` fields filled in
    (max_model_len, tokenizer, speculative and LoRA defaults, the KV connector). What the checkpoint or the
    environment cannot run is refused here, naming the field. `usage_context` is the entrypoint running the engine
    (its scheduler defaults differ: configs/scheduler_defaults.py)."""
    model_config, parallel, scheduler = config.model_config, config.parallel_config, config.scheduler_config
    assert model_config.model is not None, "the engine resolves model=None to a checkpoint first"
    # The checkpoint first: what it cannot run fails here, before any connection to Ray or placement.
    check_architecture(model_info.architecture, env)
    max_model_len = resolve_max_model_len(model_config, model_info)
    quantization = resolve_quantization(model_config, model_info)
    dp_lockstep = model_info.is_moe and parallel.enable_expert_parallel and parallel.data_parallel_size > 1
    check_parallel_layout(model_info, parallel, quantization, dp_lockstep)
    lora_config = resolve_lora_config(config.lora_config, model_info, model_config.served_model_name)
    speculative = resolve_speculative(config, model_info, draft_model_info, max_model_len, dp_lockstep, quantization,
                                      env)
    kv_transfer = resolve_kv_transfer(config)
    deployment = resolve_deployment(config, env)
    device = deployment.device
    dtype = resolve_dtype(model_config, model_info, device, env.cpu_bf16_instructions)
    if dp_lockstep and scheduler.async_scheduling:
        raise ValueError("async_scheduling is not supported with expert-parallel data parallel (MoE with "
                         "enable_expert_parallel and data_parallel_size > 1): its engines step in lock-step")
    pp = parallel.pipeline_parallel_size
    # Under PP, stage 0 learns a request's sampled token only from the next SchedulerOutput, so the scheduler must
    # not plan ahead with placeholders; async scheduling still deepens the batch queue by one step.
    max_concurrent_batches = 1 if dp_lockstep else pp + int(scheduler.async_scheduling)
    compilation = config.compilation_config
    attention_backend = choose_attention_backend(config.cache_config.attention_backend, device, dtype,
                                                 config.cache_config.block_size, compilation.custom_ops != "none", env,
                                                 attention_features(model_info.hf_config))
    query_len = uniform_decode_query_len(speculative)
    why_no_full = why_no_full_graphs(model_info.is_moe, pp > 1, device, dtype, attention_backend, query_len,
                                     env.cuda_capability)
    resolution = ResolvedConfig(
        model_info=model_info, device=device, dtype=dtype, quantization=quantization,
        attention_backend=attention_backend, executor_backend=deployment.executor_backend,
        cudagraph=plan_cuda_graphs(compilation, scheduler, device, query_len, why_no_full),
        dp_lockstep=dp_lockstep, uniform_decode_query_len=query_len, max_concurrent_batches=max_concurrent_batches,
        bundle_layout=deployment.bundle_layout, num_ray_bundles=deployment.num_ray_bundles,
        routing_policy=deployment.routing_policy,
        structured_outputs_backends=structured_outputs_backends(config.structured_outputs_config, env),
        kv_identity=KVIdentity(*model_info.checkpoint, dtype, quantization),
        draft_model_info=draft_model_info if speculative is not None and speculative.method == "draft_model" else None,
    )
    return dataclasses.replace(
        config,
        model_config=model_config.model_copy(update={
            "max_model_len": max_model_len, "tokenizer": model_config.tokenizer or model_config.model}),
        scheduler_config=resolve_scheduler_config(
            scheduler.model_copy(update={"async_scheduling": scheduler.async_scheduling and pp == 1}), device, dtype,
            usage_context),
        speculative_config=speculative,
        kv_transfer_config=kv_transfer,
        lora_config=lora_config,
        pooler_config=resolve_pooler_config(config.pooler_config, model_info.path),
        resolution=resolution,
    )
