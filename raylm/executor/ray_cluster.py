"""The connection to Ray, and what the config resolver asks of the cluster. Ray is imported only when asked for, so
an engine whose worker runs in this process (one device, the default executor) needs no Ray installed."""
from __future__ import annotations

import os


def ray_reachable() -> bool:
    """Whether this process is, or is told to be, part of a Ray cluster (a Serve replica, a Ray job, RAY_ADDRESS)."""
    if os.environ.get("RAY_ADDRESS"):
        return True
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized()


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


def cluster_has_gpus() -> bool:
    """Whether the connected cluster has GPUs (its driver's node, a CPU-only head or a Serve ingress, may have none)."""
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0
