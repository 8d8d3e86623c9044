"""The one place where an engine's config is resolved: every `auto` setting filled in and every derived fact decided,
once, logged once, frozen; every layer below reads the fields and decides nothing again.

It runs where the engine runs: in the LLMEngine's process (an `LLM`, the CLI, a Serve replica), so a Serve replica on
a GPU cluster decides from what it holds itself, not from what the process that built the app saw.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import logging

import torch

from raylm.cluster.models.default_model import resolve_model
from raylm.common.logger import show_info
from raylm.configs import EngineConfig, ModelConfig, ParallelConfig
from raylm.configs.engine_config import ResolvedConfig, SpeculativeConfig
from raylm.configs.kv_identity import kv_identity
from raylm.configs.kv_transfer import KVTransferConfig
from raylm.configs.lora import resolve_lora_config
from raylm.configs.model_info import (
    ModelInfo,
    explain_dtype,
    read_model_info,
    resolve_dtype,
    resolve_max_model_len,
    resolve_quantization,
)
from raylm.configs.parallel_checks import check_draft_tensor_parallel, check_parallel_layout
from raylm.configs.structured_outputs_config import StructuredOutputsConfig
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
    check_parallel_layout(model_info, parallel, quantization, dp_lockstep)
    lora_config = resolve_lora_config(config.lora_config, model_info, model_config.served_model_name)
    speculative, draft_model_info = _resolve_speculative(config, model_info, max_model_len, dp_lockstep, quantization)

    kv_transfer = _resolve_kv_transfer(config)
    device = decide_device(model_config, parallel)
    if kv_transfer.kv_connector is not None:  # the connectors' stores and transfers are Ray actors and objects
        initialize_ray_cluster(_num_ray_bundles(parallel))
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
    grammar_backends = structured_outputs_backends(config.structured_outputs_config)
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
        speculative_config=speculative,
        kv_transfer_config=kv_transfer,
        routing_config=config.routing_config.model_copy(update={"routing_policy": resolve_routing_policy(config)}),
        lora_config=lora_config,
        resolved=ResolvedConfig(model_info, _num_ray_bundles(parallel), dp_lockstep,
                                max_concurrent_batches, draft_model_info, grammar_backends,
                                kv_identity(model_config.model, dtype, quantization)),
    )
    show_info(logger)
    logger.info("engine config: model %s (%s), device %s, dtype %s, quantization %s, attention %s, executor %s%s, "
                "cudagraph_mode %s, max_model_len %d, %d step(s) in flight, grammars %s%s",
                model_config.served_model_name, model_info.architecture, device,
                explain_dtype(model_config, model_info, device), quantization,
                attention_backend, executor_backend,
                ", lock-step DP" if dp_lockstep else "", resolved.compilation_config.cudagraph_mode,
                max_model_len, max_concurrent_batches, "/".join(grammar_backends) or "none",
                "" if kv_transfer.kv_connector is None else
                f", KV connector {kv_transfer.kv_connector} ({kv_transfer.kv_role})")
    if speculative is not None:
        logger.info("speculative decoding: %s", speculative.model_dump(exclude_none=True))
    return resolved


# structured_outputs_backend -> the backends a constraint is tried against, in order, and the package each needs.
_GRAMMAR_BACKENDS = {"auto": ("xgrammar", "guidance"), "xgrammar": ("xgrammar",), "guidance": ("guidance",)}
_GRAMMAR_PACKAGES = {"xgrammar": "xgrammar", "guidance": "llguidance"}


def structured_outputs_backends(config: StructuredOutputsConfig) -> tuple[str, ...]:
    """The grammar backends of constrained requests, in the order each constraint tries them. `auto` is vLLM's:
    xgrammar, then guidance (llguidance) for what xgrammar cannot enforce; the choice among them is made per
    constraint (structured_output/validation.py), the list here, once."""
    backends = _GRAMMAR_BACKENDS[config.structured_outputs_backend]
    for name in backends:
        if importlib.util.find_spec(_GRAMMAR_PACKAGES[name]) is None:
            raise ValueError(f"structured_outputs_backend {config.structured_outputs_backend!r} needs the "
                             f"{_GRAMMAR_PACKAGES[name]} package, which is not installed")
    return backends


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


def _resolve_speculative(config: EngineConfig, model_info: ModelInfo, max_model_len: int, dp_lockstep: bool,
                         quantization: str) -> tuple[SpeculativeConfig | None, ModelInfo | None]:
    """speculative_config with vLLM's defaults filled in (ngram: prompt_lookup_min/max 5, or each the other's; draft
    TP: the target's), and the draft checkpoint's facts; combinations raylm cannot run are refused, naming why."""
    spec = config.speculative_config
    if spec is None:
        return None, None
    parallel, k = config.parallel_config, spec.num_speculative_tokens
    if parallel.pipeline_parallel_size > 1:
        raise ValueError("speculative_config: not supported with pipeline_parallel_size > 1: drafts are verified on "
                         "the last stage, and the first stage would need them before the step's output comes back")
    if k + 1 > config.scheduler_config.max_num_batched_tokens:
        raise ValueError(f"speculative_config.num_speculative_tokens ({k}) + 1 must be <= max_num_batched_tokens "
                         f"({config.scheduler_config.max_num_batched_tokens}): a decode step verifies k drafts at once")
    if spec.method == "ngram":
        for name in ("model", "draft_tensor_parallel_size"):
            if getattr(spec, name) is not None:
                raise ValueError(f"speculative_config.{name} is for method 'draft_model'; method 'ngram' takes none")
        lookup_max = spec.prompt_lookup_max or spec.prompt_lookup_min or 5
        lookup_min = spec.prompt_lookup_min or lookup_max
        if lookup_min > lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lookup_min}) must be <= prompt_lookup_max "
                             f"({lookup_max})")
        return spec.model_copy(update={"prompt_lookup_min": lookup_min, "prompt_lookup_max": lookup_max}), None

    for name in ("prompt_lookup_min", "prompt_lookup_max"):
        if getattr(spec, name) is not None:
            raise ValueError(f"speculative_config.{name} is for method 'ngram'; method 'draft_model' takes none")
    if spec.model is None:
        raise ValueError("speculative_config.model: method 'draft_model' needs the draft checkpoint's folder")
    tp = parallel.tensor_parallel_size
    if spec.draft_tensor_parallel_size not in (None, tp):
        raise ValueError(f"speculative_config.draft_tensor_parallel_size ({spec.draft_tensor_parallel_size}) must "
                         f"equal tensor_parallel_size ({tp}): the draft runs on the target's workers, sharded alike")
    if dp_lockstep:
        raise ValueError("speculative_config: method 'draft_model' is not supported with expert-parallel data "
                         "parallel (lock-step DP): the draft's forwards would need their own DP coordination")
    draft = read_model_info(spec.model)
    check_architecture(draft.architecture)
    if draft.vocab_size != model_info.vocab_size:
        raise ValueError(f"speculative_config.model: the draft's vocab_size ({draft.vocab_size}) differs from the "
                         f"target's ({model_info.vocab_size}); draft and target must share one vocabulary")
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config.model: the draft's max_position_embeddings "
                         f"({draft.max_position_embeddings}) is below max_model_len ({max_model_len})")
    check_draft_tensor_parallel(draft, model_info, tp, quantization, parallel.enable_expert_parallel)
    return spec.model_copy(update={"draft_tensor_parallel_size": tp}), draft


def resolve_routing_policy(config: EngineConfig) -> str:
    """"load" or "prefix" (over DP engines and Serve replicas); auto: prefix where prefix caching is on."""
    policy = config.routing_config.routing_policy
    caching = config.cache_config.enable_prefix_caching
    if policy == "auto":
        return "prefix" if caching else "load"
    if policy == "prefix" and not caching:
        raise ValueError("routing_policy 'prefix' routes to the engine holding a prompt's cached prefix: it needs "
                         "enable_prefix_caching")
    return policy


def _resolve_kv_transfer(config: EngineConfig) -> KVTransferConfig:
    """kv_offloading_size alone turns the OffloadingConnector on (as in vLLM); a connector runs on engines of one
    device each (data parallel is fine) and not with micro-batched forwards."""
    kv = config.kv_transfer_config
    if kv.kv_connector is None and kv.kv_offloading_size is not None:
        kv = kv.model_copy(update={"kv_connector": "OffloadingConnector", "kv_role": "kv_both"})
    if kv.kv_connector is None:
        return kv
    parallel = config.parallel_config
    if parallel.world_size != 1:
        raise ValueError(f"kv_connector {kv.kv_connector}: raylm's KV connectors run on engines of one device "
                         f"(tensor_parallel_size x pipeline_parallel_size is {parallel.world_size}); use "
                         f"data_parallel_size for more engines")
    if parallel.enable_dbo:
        raise ValueError(f"kv_connector {kv.kv_connector}: not with enable_dbo (a layer's KV is saved once per "
                         f"forward, not per micro-batch)")
    if kv.kv_connector == "OffloadingConnector":
        if kv.kv_offloading_size is None:
            raise ValueError("kv_offloading_size: the OffloadingConnector needs the host memory to use (GiB)")
        if not config.cache_config.enable_prefix_caching:
            raise ValueError("kv_connector OffloadingConnector keeps evicted prefix-cache blocks: it needs "
                             "enable_prefix_caching")
    return kv
