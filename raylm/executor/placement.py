"""Where an engine's workers run: the Ray cluster, one placement group per engine, and the rank of each worker.

The placement group holds the engine's own bundle first (pinned to the engine's node), then its workers': the layout
resolution decided (configs/bundles.py: one bundle per TP group when the cluster's nodes can hold them so, else one
per device). Before creating it, raylm checks that the cluster can hold it at all (see
executor/cluster_resources.py). Ranks take whole TP groups node by node, the engine's node first; only the TP groups
that cannot be whole straddle nodes, with a warning.
"""
from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup

from raylm.common.logger import show_info
from raylm.common.parallel_layout import RankLayout
from raylm.configs import ParallelConfig
from raylm.configs.bundles import EngineBundles
from raylm.executor.cluster_resources import ClusterCapacity, check_fits, wait_until_ready

logger = logging.getLogger(__name__)

_LOCALHOST = "127.0.0.1"


def describe_engine(layout: EngineBundles, parallel_config: ParallelConfig) -> str:
    """What an engine asks for, saying that its own bundle comes on top of its workers'."""
    if not layout.workers:
        return layout.describe()
    tp, pp = parallel_config.tensor_parallel_size, parallel_config.pipeline_parallel_size
    return (f"{len(layout.bundles)} bundles for TP={tp} x PP={pp} = {tp * pp} workers and the engine itself: "
            f"{layout.describe()}")


def reserve_dp_placement_groups(parallel_config: ParallelConfig, layout: EngineBundles) -> list[PlacementGroup]:
    """One placement group per DP engine, each of the resolved `layout`: the engine actor takes bundle 0 and its
    RayExecutor the rest (an engine whose worker runs in its own process: its device's bundle alone)."""
    num_engines, strategy = parallel_config.data_parallel_size, parallel_config.placement_group_strategy
    capacity = ClusterCapacity.current()
    what = f"{num_engines} DP engines, each {describe_engine(layout, parallel_config)}"
    check_fits(layout.bundles, strategy, what, capacity)  # the strategy holds within one group
    check_fits(layout.bundles * num_engines, "PACK", what, capacity)
    suffix = uuid.uuid4().hex[:8]
    groups = [ray.util.placement_group(layout.bundles, strategy=strategy, name=f"raylm-dp{rank}-{suffix}")
              for rank in range(num_engines)]
    try:
        wait_until_ready(groups, what)
    except BaseException:
        for group in groups:
            ray.util.remove_placement_group(group)
        raise
    return groups


def bundle_node_ids(placement_group: PlacementGroup) -> dict[int, str]:
    return ray.util.placement_group_table(placement_group)["bundles_to_node_id"]


def assign_ranks(bundle_nodes: dict[int, str], workers_per_bundle: int, tp_size: int, engine_node_id: str
                 ) -> list[int]:
    """The bundle of each rank (consecutive ranks form a TP group): whole TP groups first, node by node from the
    engine's node, then those that have to straddle nodes, from the rest."""
    slots: dict[str, list[int]] = {}
    for bundle in sorted(bundle_nodes, key=lambda b: (bundle_nodes[b] != engine_node_id, bundle_nodes[b], b)):
        slots.setdefault(bundle_nodes[bundle], []).extend([bundle] * workers_per_bundle)
    whole, rest = [], []
    for node_slots in slots.values():
        cut = len(node_slots) - len(node_slots) % tp_size
        whole += node_slots[:cut]
        rest += node_slots[cut:]
    return whole + rest


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


def create_placement_plan(parallel_config: ParallelConfig, layout: EngineBundles) -> PlacementPlan:
    """Reserve the engine's resolved bundle `layout` (or take the placement group this process already runs in, as a
    Serve replica or a DP engine does, laid out alike) and give every rank its bundle."""
    engine_node_id = ray.get_runtime_context().get_node_id()
    node_ips = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    placement_group = ray.util.get_current_placement_group()
    owned = placement_group is None
    if placement_group is None:
        placement_group = _reserve(parallel_config, layout, f"node:{node_ips[engine_node_id]}")
    try:
        bundle_nodes = bundle_node_ids(placement_group)
        device_bundles = _device_bundles(bundle_nodes, parallel_config)
        order = assign_ranks(device_bundles, parallel_config.world_size // len(device_bundles),
                             parallel_config.tensor_parallel_size, engine_node_id)
    except BaseException:
        if owned:
            ray.util.remove_placement_group(placement_group)
        raise
    plan = PlacementPlan(placement_group, owned, order, [bundle_nodes[b] for b in order],
                         [node_ips[bundle_nodes[b]] for b in order], engine_node_id, node_ips[engine_node_id])
    _log_layout(plan, parallel_config)
    return plan


def _reserve(parallel_config: ParallelConfig, layout: EngineBundles, pin: str) -> PlacementGroup:
    """The engine's placement group, once ready, its own bundle on this node; ValueError at once if the cluster can
    never hold it."""
    capacity = ClusterCapacity.current()
    if pin in capacity.totals:
        layout = layout.pinned(pin)
    what = describe_engine(layout, parallel_config)
    strategy = parallel_config.placement_group_strategy
    check_fits(layout.bundles, strategy, what, capacity)
    placement_group = ray.util.placement_group(layout.bundles, strategy=strategy, name=f"raylm-{uuid.uuid4().hex[:8]}")
    try:
        wait_until_ready([placement_group], what)
    except BaseException:
        ray.util.remove_placement_group(placement_group)
        raise
    return placement_group


def _device_bundles(bundle_nodes: dict[int, str], parallel_config: ParallelConfig) -> dict[int, str]:
    """The workers' bundles (all but the engine's bundle 0) of a group laid out by engine_bundles: one per TP group
    or one per device."""
    world_size, pp = parallel_config.world_size, parallel_config.pipeline_parallel_size
    num_device_bundles = len(bundle_nodes) - 1
    if num_device_bundles == pp and parallel_config.tensor_parallel_size > 1:
        return {b: bundle_nodes[b] for b in range(1, pp + 1)}
    if num_device_bundles >= world_size:
        return {b: bundle_nodes[b] for b in range(1, world_size + 1)}
    raise ValueError(f"the placement group has {len(bundle_nodes)} bundles; the engine needs its own bundle and then "
                     f"one per TP group ({pp}) or one per device ({world_size}) (see "
                     f"raylm.configs.bundles.engine_bundles)")


def _log_layout(plan: PlacementPlan, parallel_config: ParallelConfig) -> None:
    """One line at start-up, rank -> node, and a warning for each TP group that spans nodes."""
    layout = RankLayout(parallel_config.tensor_parallel_size, parallel_config.pipeline_parallel_size)
    show_info(logger)
    logger.info("placement (TP=%d x PP=%d, engine on %s): %s", layout.tp_size, layout.pp_size,
                _node_name(plan.engine_node_ip, plan.engine_node_id), ", ".join(
                    f"rank {rank} -> {_node_name(plan.node_ips[rank], plan.node_ids[rank])}"
                    for rank in range(len(plan.node_ids))))
    for group in layout.tp_groups():
        nodes = {plan.node_ids[rank] for rank in group}
        if len(nodes) > 1:
            logger.warning("tensor-parallel ranks %s span nodes %s: every layer's all-reduce crosses the network "
                           "(no node had room for the whole group)", group,
                           sorted(_node_name(plan.node_ips[rank], plan.node_ids[rank]) for rank in group))


def _node_name(ip: str, node_id: str) -> str:
    return f"{ip} ({node_id[:8]})"


