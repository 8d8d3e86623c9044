"""What one processor replica asks Ray for: its engine's bundles, as a Serve replica does (serve/app.py). An engine
that runs Ray workers (TP / PP, or the ray executor) gets a placement group per replica, created as Ray Data starts
the replica; the replica takes bundle 0 (the engine's own) and its executor's workers the rest. An engine that
computes in the replica's process asks for its device there. The device, the executor and the bundles are
config_resolver.replica_deployment's, as a Serve replica's are: resolution decides them, nothing here."""
from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raylm.cluster.engine.config_resolver import replica_deployment
from raylm.configs import EngineConfig
from raylm.executor.cluster_resources import Bundle, ClusterCapacity, check_fits
from raylm.executor.placement import describe_engine

_REPLICA_CPUS = 1.0  # the engine's own bundle; its CPU engine computes with every core of the process regardless


def replica_remote_args(config: EngineConfig, placement_group_config: dict[str, Any] | None) -> dict[str, Any]:
    """map_batches' Ray arguments for the replica actors; a placement group the cluster can never hold fails here,
    not as replicas pending forever."""
    parallel, deployment = config.parallel_config, replica_deployment(config)
    runs_workers = deployment.executor_backend == "ray"
    if placement_group_config is not None:
        bundles, strategy = placement_group_config["bundles"], placement_group_config.get("strategy", "PACK")
        what = f"placement_group_config {placement_group_config}"
    elif runs_workers:
        layout = deployment.bundle_layout
        bundles, strategy, what = layout.bundles, parallel.placement_group_strategy, describe_engine(layout, parallel)
    else:
        return {"num_cpus": _REPLICA_CPUS, "num_gpus": 1 if deployment.device == "cuda" else 0}
    check_fits(bundles, strategy, what, ClusterCapacity.current())
    if not runs_workers:  # one process: its resources are the bundles' sum
        totals: Counter[str] = Counter()
        for bundle in bundles:
            totals.update(bundle)
        args: dict[str, Any] = {"num_cpus": totals.pop("CPU", 0.0), "num_gpus": totals.pop("GPU", 0.0)}
        return args | ({"resources": dict(totals)} if totals else {})
    first = bundles[0]
    return {"num_cpus": first.get("CPU", 0.0), "num_gpus": first.get("GPU", 0.0),
            "ray_remote_args_fn": functools.partial(replica_placement_group, bundles, strategy)}


def replica_placement_group(bundles: list[Bundle], strategy: str) -> dict[str, Any]:
    """Called by Ray Data before it starts each replica: a placement group of its own, the replica in bundle 0, the
    engine's worker actors captured into the group (placement.create_placement_plan takes the current group)."""
    group = ray.util.placement_group(bundles, strategy=strategy)
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)}
