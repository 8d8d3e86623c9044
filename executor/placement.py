"""Where an engine's workers run: the Ray cluster, one placement group per engine, and the rank of each bundle.

The placement group holds the engine's own bundle first (pinned to the engine's node), then one bundle per device.
Ranks follow the device bundles sorted engine node first, then node by node, so consecutive ranks (a TP group) share
a node whenever nodes hold whole TP groups.
"""
from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup

from configs import ModelConfig, ParallelConfig
from runner.parallel_state import RankLayout

logger = logging.getLogger(__name__)

PG_READY_TIMEOUT_S = 1800.0  # a cluster may be scaling up to fit the group
_LOCALHOST = "127.0.0.1"


def initialize_ray_cluster(num_bundles: int) -> None:
    """Connect to Ray: the one already initialised, the cluster at RAY_ADDRESS (`auto` for a `ray start` cluster on
    this machine), or a new local one of our own."""
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"])
        return
    # Declare a CPU for each bundle (engines' and workers') even on a small machine: CPU workers share the cores
    # through torch's thread count, not through Ray.
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, num_bundles))


def resolve_device(model_config: ModelConfig) -> str:
    """The workers' device: "auto" means CUDA when the cluster has GPUs (the engine's own node may have none)."""
    if model_config.device != "auto":
        return model_config.device
    return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"


def placement_bundles(world_size: int, device: str) -> list[dict[str, float]]:
    """The engine's bundle, then one per worker: also what a Ray Serve replica passes as placement_group_bundles."""
    return [{"CPU": 1.0}] + [_device_bundle(device) for _ in range(world_size)]


def _device_bundle(device: str) -> dict[str, float]:
    return {"GPU": 1.0} if device == "cuda" else {"CPU": 1.0}


def reserve_dp_placement_groups(parallel_config: ParallelConfig, device: str, in_process_worker: bool
                                ) -> list[PlacementGroup]:
    """One placement group per DP engine, each laid out by placement_bundles: the engine actor takes bundle 0 and its
    RayExecutor the rest. An engine whose worker runs in its own process (in_process_worker: one device, the uni
    executor) needs only its device's bundle."""
    num_engines, world_size = parallel_config.data_parallel_size, parallel_config.world_size
    bundles = [_device_bundle(device)] if in_process_worker else placement_bundles(world_size, device)
    suffix = uuid.uuid4().hex[:8]
    groups = [ray.util.placement_group(bundles, strategy=parallel_config.placement_group_strategy,
                                       name=f"raylm-dp{rank}-{suffix}") for rank in range(num_engines)]
    try:
        for group in groups:
            _wait_until_ready(group)
    except BaseException:
        for group in groups:
            ray.util.remove_placement_group(group)
        raise
    return groups


def bundle_node_ids(placement_group: PlacementGroup) -> dict[int, str]:
    return ray.util.placement_group_table(placement_group)["bundles_to_node_id"]


def sort_bundles_by_node(bundle_nodes: dict[int, str], engine_node_id: str) -> list[int]:
    """Bundle indices in rank order: the engine's node first, then node by node, by index within a node."""
    return sorted(bundle_nodes, key=lambda b: (bundle_nodes[b] != engine_node_id, bundle_nodes[b], b))


@dataclass
class PlacementPlan:
    placement_group: PlacementGroup
    owned: bool  # created for this engine, so removed with it (a Serve replica's own group is not)
    bundle_indices: list[int]  # per rank
    node_ids: list[str]  # per rank
    node_ips: list[str]  # per rank
    engine_node_id: str
    engine_node_ip: str

    def num_local_workers(self, rank: int) -> int:
        return self.node_ids.count(self.node_ids[rank])

    @property
    def rendezvous_host(self) -> str:
        """Where rank 0 serves the torch.distributed store: loopback on one node, which multi-NIC hosts cannot get
        wrong."""
        return _LOCALHOST if len(set(self.node_ids)) == 1 else self.node_ips[0]

    @property
    def control_host(self) -> str:
        """Where the engine listens for its workers' control connections."""
        return _LOCALHOST if set(self.node_ids) == {self.engine_node_id} else self.engine_node_ip


def create_placement_plan(parallel_config: ParallelConfig, device: str) -> PlacementPlan:
    """Reserve the engine's bundles (or take the placement group this process already runs in, as a Serve replica
    does, laid out by placement_bundles) and give every rank its bundle."""
    world_size = parallel_config.world_size
    engine_node_id = ray.get_runtime_context().get_node_id()
    node_ips = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    placement_group = ray.util.get_current_placement_group()
    owned = placement_group is None
    if placement_group is None:
        bundles = placement_bundles(world_size, device)
        pin = f"node:{node_ips[engine_node_id]}"
        if pin in ray.cluster_resources():
            bundles[0][pin] = 0.001
        placement_group = ray.util.placement_group(bundles, strategy=parallel_config.placement_group_strategy,
                                                   name=f"raylm-{uuid.uuid4().hex[:8]}")
    try:
        _wait_until_ready(placement_group)
        bundle_nodes = bundle_node_ids(placement_group)
        if len(bundle_nodes) < world_size + 1:
            raise ValueError(f"placement group has {len(bundle_nodes)} bundles; the engine needs its own bundle and "
                             f"{world_size} worker bundles (see executor.placement.placement_bundles)")
        device_bundles = {b: bundle_nodes[b] for b in range(1, world_size + 1)}
        order = sort_bundles_by_node(device_bundles, engine_node_id)
    except BaseException:
        if owned:
            ray.util.remove_placement_group(placement_group)
        raise
    plan = PlacementPlan(placement_group, owned, order, [device_bundles[b] for b in order],
                         [node_ips[device_bundles[b]] for b in order], engine_node_id, node_ips[engine_node_id])
    _warn_split_tp_groups(plan, parallel_config)
    return plan


def _wait_until_ready(placement_group: PlacementGroup) -> None:
    start = time.monotonic()
    while not ray.wait([placement_group.ready()], timeout=10.0)[0]:
        waited = time.monotonic() - start
        message = (f"placement group {placement_group.bundle_specs} is not ready after {waited:.0f} s; available "
                   f"resources: {ray.available_resources()}. Check `ray status`.")
        if waited > PG_READY_TIMEOUT_S:
            raise RuntimeError(message)
        logger.warning(message)


def _warn_split_tp_groups(plan: PlacementPlan, parallel_config: ParallelConfig) -> None:
    layout = RankLayout(parallel_config.tensor_parallel_size, parallel_config.pipeline_parallel_size)
    for group in layout.tp_groups():
        nodes = {plan.node_ips[rank] for rank in group}
        if len(nodes) > 1:
            logger.warning("tensor-parallel ranks %s span nodes %s: every layer's all-reduce crosses the network",
                           group, sorted(nodes))
