"""Whether an engine's workers run on Ray, and the one decision of their device. Ray is imported only when they do,
so an engine whose worker runs in this process (one device, the default executor) needs no Ray installed."""
from __future__ import annotations

import dataclasses
import os

from raylm.configs import EngineConfig, ModelConfig, ParallelConfig
from raylm.runner.platform import device_type


def initialize_ray_cluster(num_bundles: int) -> None:
    """Connect to Ray: the one already initialised, the cluster at RAY_ADDRESS (`auto` for a `ray start` cluster on
    this machine), or a new local one of our own."""
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"])
        return
    # Declare a CPU for each bundle (engines' and workers') even on a small machine: CPU workers share the cores
    # through torch's thread count, not through Ray.
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, num_bundles))


def workers_on_ray(parallel_config: ParallelConfig) -> bool:
    """Whether the engine's workers (or its data-parallel engines) run as Ray actors rather than in this process."""
    return (parallel_config.world_size > 1 or parallel_config.distributed_executor_backend == "ray"
            or parallel_config.data_parallel_size > 1)


def resolve_device(model_config: ModelConfig, on_ray: bool = True) -> str:
    """The one decision of the workers' device. "auto" on Ray means CUDA when the cluster has GPUs (the driver's
    node, a CPU-only head or a Serve ingress, may have none); in this process, when torch sees CUDA."""
    if not on_ray:
        return device_type(model_config)
    if model_config.device != "auto":
        return model_config.device
    import ray

    return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"


def decide_device(config: EngineConfig) -> EngineConfig:
    """`config` with its device decided once, connecting to Ray first when the workers run there: the dtype "auto",
    the engines and the workers all take this value, whatever the driver's own node has."""
    parallel = config.parallel_config
    on_ray = workers_on_ray(parallel)
    if on_ray and config.model_config.device == "auto":
        initialize_ray_cluster(parallel.data_parallel_size * (parallel.world_size + 1))
    device = resolve_device(config.model_config, on_ray)
    return dataclasses.replace(config, model_config=config.model_config.model_copy(update={"device": device}))
