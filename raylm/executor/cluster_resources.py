"""Whether an engine's placement group fits the Ray cluster: never (raise at once), not yet (wait, up to a timeout),
or now.

"Never" compares the bundles with what the cluster has in total, and each bundle with the largest node (a bundle
lives on one node); on an autoscaling cluster it counts the nodes the autoscaler may still add. Ray itself would keep
an impossible group pending forever, so the error says what is missing instead.
"""
from __future__ import annotations

import logging
import math
import os
import time
from collections import Counter
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup

from raylm.configs.bundles import NODE_PREFIX, Bundle, fits, format_resources
from raylm.configs.envs import RAYLM_PLACEMENT_GROUP_TIMEOUT_S, placement_group_timeout_s

logger = logging.getLogger(__name__)


def process_cores() -> int:
    """The CPU cores this process may run on (its affinity mask): what a CPU engine's torch threads divide."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


_LOG_INTERVAL_S = 10.0
_MAX_NODES_PER_TYPE = 64  # of one autoscaler node type, when checking where bundles go: more than any engine needs
_ADVICE = ("Lower tensor_parallel_size / pipeline_parallel_size / data_parallel_size, or give the cluster more "
           "resources (`ray status` lists them).")


@dataclass(frozen=True)
class ClusterCapacity:
    """What the cluster has, or can grow to: the resources of every node it has (or may add), and the totals."""

    nodes: list[Bundle]
    totals: Bundle

    @classmethod
    def current(cls) -> ClusterCapacity:
        nodes = [dict(node["Resources"]) for node in ray.nodes() if node["Alive"]]
        totals = dict(ray.cluster_resources())
        # Counted on top of the nodes already up: an over-estimate, which can only turn a "never" into a wait.
        for shape, max_count in _autoscaler_node_types():
            nodes += [dict(shape)] * int(min(max_count, _MAX_NODES_PER_TYPE))
            for name, amount in shape.items():
                totals[name] = totals.get(name, 0.0) + amount * max_count
        return cls(nodes, totals)


def total_resources(bundles: list[Bundle]) -> Bundle:
    totals: Counter[str] = Counter()
    for bundle in bundles:
        totals.update(bundle)
    return {name: amount for name, amount in totals.items() if not name.startswith(NODE_PREFIX)}


def check_fits(bundles: list[Bundle], strategy: str, what: str, capacity: ClusterCapacity | None = None) -> None:
    """Raise ValueError, naming what is missing, when the cluster can never hold these bundles (`what` describes
    them) under the placement strategy; return when it can, now or once other groups free their share."""
    capacity = capacity or ClusterCapacity.current()
    needed = total_resources(bundles)
    problems = [f"{name}: {amount:g} needed, the cluster has {capacity.totals.get(name, 0.0):g}"
                for name, amount in sorted(needed.items()) if amount > capacity.totals.get(name, 0.0) + 1e-9]
    if not problems:
        problems = [_no_node_message(bundle, capacity.nodes) for bundle in bundles
                    if not any(fits(bundle, node) for node in capacity.nodes)][:1]
    if not problems and strategy == "STRICT_PACK" and not any(fits(needed, node) for node in capacity.nodes):
        problems = [f"STRICT_PACK puts them all on one node, and no node has {format_resources(needed)}"]
    if not problems and strategy == "STRICT_SPREAD" and len(bundles) > len(capacity.nodes):
        problems = [f"STRICT_SPREAD puts each on its own node, and the cluster has {len(capacity.nodes)} nodes"]
    if problems:
        raise ValueError(f"the Ray cluster can never hold this placement group: it needs {what}, "
                         f"{format_resources(needed)} in all; {'; '.join(problems)}. {_ADVICE}")


def wait_until_ready(placement_groups: list[PlacementGroup], what: str) -> None:
    """Wait until every group is placed, up to RAYLM_PLACEMENT_GROUP_TIMEOUT_S (the cluster holds them, but other
    work has the resources now); then raise TimeoutError with what is needed and what is free."""
    timeout = placement_group_timeout_s()
    start = time.monotonic()
    pending = [group.ready() for group in placement_groups]
    while True:
        waited = time.monotonic() - start
        wait_s = max(0.0, min(_LOG_INTERVAL_S, timeout - waited))
        pending = ray.wait(pending, num_returns=len(pending), timeout=wait_s)[1]
        if not pending:
            return
        waited = time.monotonic() - start
        needed = total_resources([b for group in placement_groups for b in group.bundle_specs])
        available = ray.available_resources()
        free = {name: available.get(name, 0.0) for name in needed}
        message = (f"placement group not ready after {waited:.0f} s: it needs {what}, {format_resources(needed)} "
                   f"in all, and the cluster has {format_resources(free)} free (other placement groups or tasks "
                   f"hold the rest; `ray status` shows them)")
        if waited >= timeout:
            raise TimeoutError(f"{message}. Gave up after {RAYLM_PLACEMENT_GROUP_TIMEOUT_S}={timeout:g} s.")
        logger.warning(message)


def _no_node_message(bundle: Bundle, nodes: list[Bundle]) -> str:
    pins = [name for name in bundle if name.startswith(NODE_PREFIX)]
    if pins and not any(fits({pin: bundle[pin] for pin in pins}, node) for node in nodes):
        return f"no node has the resource {pins[0]} that pins the engine's bundle to the engine's node"
    if pins:
        home = [format_resources(node) for node in nodes if fits({pin: bundle[pin] for pin in pins}, node)]
        return (f"the engine's bundle {format_resources(bundle)} must be on the engine's node ({pins[0]}), which "
                f"has {home[0]}")
    largest = max(nodes, key=lambda node: sum(node.get(name, 0.0) for name in bundle), default={})
    return (f"a bundle lives on one node, and no node can hold {format_resources(bundle)} (the largest has "
            f"{format_resources({name: largest.get(name, 0.0) for name in bundle})})")


def _autoscaler_node_types() -> list[tuple[Bundle, float]]:
    """(resources, most nodes, inf for no limit) per node type of the autoscaler's config; none without an
    autoscaler. Ray Train asks the same private API before it waits for a placement group."""
    try:
        config = ray._private.state.state.get_cluster_config()
    except Exception:  # an older Ray, or a cluster without the autoscaler's state
        return []
    if config is None:
        return []
    types = []
    for group in config.node_group_configs:
        max_count = group.max_count if group.max_count >= 0 else math.inf
        if max_count and group.resources:
            types.append((dict(group.resources), max_count))
    return types
