"""The connection to Ray, and what the engine's environment facts read of the cluster. Ray is imported only when asked
for, so an engine whose worker runs in this process (one device, the default executor) needs no Ray installed."""
from __future__ import annotations

import os

from raylm.configs.bundles import Bundle


def ray_reachable() -> bool:
    """Whether this process is, or is told to be, part of a Ray cluster (a Serve replica, a Ray job, RAY_ADDRESS)."""
    if os.environ.get("RAY_ADDRESS"):
        return True
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized()


def join_ray_cluster() -> None:
    """Connect to the cluster this process is in or RAY_ADDRESS names; never start one."""
    import ray

    if not ray.is_initialized():
        ray.init(address=os.environ["RAY_ADDRESS"])


def initialize_ray_cluster(num_bundles: int) -> None:
    """Connect to Ray, for whoever places workers (the Ray executor, the DP client, a KV connector's engine): the one
    already initialised, the cluster at RAY_ADDRESS (`auto` for a `ray start` cluster on this machine), or a new
    local one of our own."""
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"])
        return
    # Declare a CPU for each bundle (engines' and workers') even on a small machine: CPU workers share the cores
    # through torch's thread count, not through Ray. (EnvironmentFacts.nodes_for expects this node.)
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, num_bundles))


def cluster_nodes() -> list[Bundle]:
    """The connected cluster's nodes (with those its autoscaler may add): what the bundle layout is decided on."""
    from raylm.executor.cluster_resources import ClusterCapacity

    return ClusterCapacity.current().nodes
