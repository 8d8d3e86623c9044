"""The engine's side of resolution: where the engine runs (an `LLM`, the CLI, a Serve replica, a job), read what
resolution needs and cannot see itself, then hand it to the pure resolve_config (raylm/configs/resolve.py), once:
the checkpoint (model=None built or fetched by cluster/models/default_model.py, an object-storage URI copied to this
node, its facts read once) and the environment's facts (gather_environment). Nothing here decides; the start-up
line says what was decided.

A Serve replica on a GPU cluster resolves from what it holds itself, not from what the process that built the app saw;
the builders that size replicas (Serve, the batch processor) ask replica_deployment what that will be.
"""
from __future__ import annotations

import dataclasses
import logging

from raylm.cluster.engine.environment import gather_environment
from raylm.cluster.models.default_model import resolve_model
from raylm.common.logger import show_info
from raylm.common.object_storage import check_source, is_object_uri, local_copy
from raylm.configs import EngineConfig
from raylm.configs.attention_backends import attention_features, explain_attention_backend
from raylm.configs.engine_config import LoRAConfig
from raylm.configs.environment import EnvironmentFacts
from raylm.configs.lora import parse_lora_modules
from raylm.configs.model_info import ModelInfo, explain_dtype, read_model_info
from raylm.configs.resolve import Deployment, resolve_config, resolve_deployment
from raylm.configs.scheduler_defaults import UsageContext

logger = logging.getLogger(__name__)


def resolve_engine_config(config: EngineConfig, usage_context: UsageContext = "engine_context") -> EngineConfig:
    """`config` with every decision made (configs/resolve.py) for the entrypoint `usage_context`; a resolved config
    comes back as it is."""
    if config.resolution is not None:
        return config
    model = config.model_config.model
    source = model if is_object_uri(model) else ""
    config = dataclasses.replace(config, model_config=resolve_model(config.model_config))
    model = config.model_config.model
    assert model is not None
    model_info = _with_source(read_model_info(model), source)
    spec = config.speculative_config
    draft = None
    if spec is not None and spec.method == "draft_model" and spec.model is not None:
        if is_object_uri(spec.model):
            draft = _with_source(read_model_info(str(local_copy(spec.model, "speculative_config.model"))), spec.model)
        else:
            draft = read_model_info(spec.model)
    _check_lora_sources(config.lora_config)
    env = gather_environment(config)
    resolved = resolve_config(config, model_info, env, draft, usage_context)
    _log_engine_config(resolved, env)
    return resolved


def _with_source(info: ModelInfo, source: str) -> ModelInfo:
    """A copy's facts, naming the URI it came from: the workers copy it to their nodes, and the KV identity names the
    URI rather than this node's cache path, so engines on nodes with other caches still share KV."""
    if not source:
        return info
    return dataclasses.replace(info, source=source, checkpoint=(source, info.checkpoint[1]))


def _check_lora_sources(lora: LoRAConfig) -> None:
    """Adapters in object storage are copied when first used; a URI that cannot be read fails here, before any
    worker is placed."""
    for name, path in parse_lora_modules(lora.lora_modules).items():
        if is_object_uri(path):
            check_source(path, f"lora_modules ({name})")
    dynamic = lora.dynamic_lora_loading_path
    if is_object_uri(dynamic):
        check_source(dynamic, "dynamic_lora_loading_path")


def replica_deployment(config: EngineConfig) -> Deployment:
    """What a replica's engine will decide of its device, executor, bundles and routing (configs/resolve.py's
    resolve_deployment, no checkpoint read, no kernel tried), from the facts the replica will see: the cluster of
    this process (when Ray is connected as the replica is sized), and one GPU in the replica itself where the cluster
    has GPUs (its builder gives it one when its engine then computes in-process). The one source of a replica's
    resources for the Serve builder (serve/app.py) and the batch processor (batch/replica_resources.py)."""
    facts = gather_environment(config, kernels=False)
    return resolve_deployment(config, replica_facts(facts))


def replica_facts(builder: EnvironmentFacts) -> EnvironmentFacts:
    """The environment a replica will see, from its builder's: its cluster, and a GPU of its own where the cluster
    has any."""
    return dataclasses.replace(builder, cuda_devices=1 if builder.cluster_gpus else 0)


def _log_engine_config(config: EngineConfig, env: EnvironmentFacts) -> None:
    """The one start-up line of the engine's config: every decision, and why where it may surprise."""
    resolved, model_config = config.resolved, config.model_config
    model_info: ModelInfo = resolved.model_info
    show_info(logger)
    logger.info("engine config: model %s (%s), device %s, dtype %s, quantization %s, attention %s, executor %s%s%s, "
                "cudagraph_mode %s%s, max_model_len %s, %d step(s) in flight, routing %s, grammars %s%s",
                model_config.served_model_name, model_info.architecture, resolved.device,
                explain_dtype(model_config, model_info, resolved.device, env.cpu_bf16_instructions),
                resolved.quantization,
                explain_attention_backend(config.cache_config.attention_backend, resolved.device, resolved.dtype,
                                          config.cache_config.block_size,
                                          config.compilation_config.custom_ops != "none", env,
                                          attention_features(model_info.hf_config)),
                resolved.executor_backend,
                " (auto)" if config.parallel_config.distributed_executor_backend is None else "",
                ", lock-step DP" if resolved.dp_lockstep else "", resolved.cudagraph.mode, _graph_detail(config),
                model_config.max_model_len, resolved.max_concurrent_batches, resolved.routing_policy,
                "/".join(resolved.structured_outputs_backends) or "none",
                "" if config.kv_transfer_config.kv_connector is None else
                f", KV connector {config.kv_transfer_config.kv_connector} ({config.kv_transfer_config.kv_role})")
    if config.speculative_config is not None:
        logger.info("speculative decoding: %s", config.speculative_config.model_dump(exclude_none=True))


def _graph_detail(config: EngineConfig) -> str:
    """Why FULL graphs were turned off, or the batch sizes captured and which setting chose them."""
    graphs, compilation = config.resolved.cudagraph, config.compilation_config
    if graphs.why_no_full:
        return f" (no FULL graphs: {graphs.why_no_full})"
    if not graphs.capture_sizes:
        return ""
    source = ("cudagraph_capture_sizes" if compilation.cudagraph_capture_sizes is not None else
              "max_cudagraph_capture_size" if compilation.max_cudagraph_capture_size is not None else "default")
    return f" (batch sizes {graphs.capture_sizes[0]}-{graphs.capture_sizes[-1]}, {len(graphs.capture_sizes)} " \
           f"graphs, {source})"
