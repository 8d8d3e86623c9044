"""An engine's placement-group layout, decided once at resolution (configs/resolve.py) from the cluster's node shapes:
the engine's own bundle first, then its workers', one per TP group when the nodes can hold them so (Ray keeps a bundle
on one node, so no TP group straddles nodes), else one per device. Pure data and arithmetic: the executor reserves the
layout (executor/placement.py) and the Serve builder hands it to Serve (cluster/serve/app.py)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from raylm.configs.engine_config import ParallelConfig

Bundle = dict[str, float]
NODE_PREFIX = "node:"  # Ray's per-node resource, used to pin a bundle to a node
_PIN = 0.001  # of the engine node's `node:<ip>` resource: keeps the engine's bundle on the engine's node


@dataclass(frozen=True)
class EngineBundles:
    """One engine's placement group: the engine's own bundle first, then its workers', one per device or one per TP
    group (`workers_per_bundle`, so that Ray keeps each TP group on one node)."""

    engine: Bundle
    workers: tuple[Bundle, ...]
    workers_per_bundle: int = 1

    @property
    def bundles(self) -> list[Bundle]:
        return [dict(self.engine), *(dict(bundle) for bundle in self.workers)]

    def pinned(self, pin: str) -> EngineBundles:
        """The layout with the engine's bundle kept on the node that has the resource `pin` (`node:<ip>`)."""
        return replace(self, engine={**self.engine, pin: _PIN})

    def describe(self) -> str:
        """E.g. "the engine's bundle {CPU: 1} + 4 worker bundles {CPU: 1}": the engine needs one bundle more than
        it has workers."""
        text = f"the engine's bundle {format_resources(self.engine)}"
        count = len(self.workers)
        if count == 0:
            return text + " (its one worker runs inside the engine)"
        plural = "s" if count > 1 else ""
        if self.workers_per_bundle == 1:
            return text + f" + {count} worker bundle{plural} {format_resources(self.workers[0])}"
        return (text + f" + {count} bundle{plural} {format_resources(self.workers[0])} of one TP group "
                       f"({self.workers_per_bundle} workers) each")


def engine_bundles(parallel_config: ParallelConfig, device: str, nodes: list[Bundle] | None,
                   num_engines: int = 1) -> EngineBundles:
    """One engine's bundles: a bundle per TP group when `nodes` (the cluster's, None: not known) hold all
    `num_engines` engines laid out so, else a bundle per device."""
    engine = {"CPU": 1.0}
    tp, pp = parallel_config.tensor_parallel_size, parallel_config.pipeline_parallel_size
    per_device = EngineBundles(engine, (device_bundle(device),) * (tp * pp))
    if tp == 1 or nodes is None:
        return per_device
    per_tp_group = EngineBundles(engine, (device_bundle(device, tp),) * pp, workers_per_bundle=tp)
    return per_tp_group if packs(per_tp_group.bundles * num_engines, nodes) else per_device


def device_bundle(device: str, count: int = 1) -> Bundle:
    return {"GPU": float(count)} if device == "cuda" else {"CPU": float(count)}


def format_resources(resources: Bundle) -> str:
    shown = {name: amount for name, amount in resources.items() if not name.startswith(NODE_PREFIX)}
    return "{" + ", ".join(f"{name}: {amount:g}" for name, amount in sorted(shown.items())) + "}"


def fits(bundle: Bundle, free: Bundle) -> bool:
    return all(amount <= free.get(name, 0.0) + 1e-9 for name, amount in bundle.items())


def packs(bundles: list[Bundle], nodes: list[Bundle]) -> bool:
    """Whether first-fit, pinned and largest bundles first, places every bundle on the nodes: True proves that the
    bundles fit; False only suggests that they may not."""
    free = [dict(node) for node in nodes]
    order = sorted(bundles, key=lambda b: (not any(n.startswith(NODE_PREFIX) for n in b), -sum(b.values())))
    for bundle in order:
        node = next((node for node in free if fits(bundle, node)), None)
        if node is None:
            return False
        for name, amount in bundle.items():
            node[name] = node.get(name, 0.0) - amount
    return True
