"""Communication for expert parallelism: the dispatch/combine managers, one place to add a backend."""
from __future__ import annotations

from raylm.runner.distributed.all2all import All2AllManager, All2AllManagerBase, DispatchHandle, combine_topk
from raylm.runner.group_coordinator import GroupCoordinator

_BACKENDS: dict[str, type[All2AllManagerBase]] = {"all_to_all_single": All2AllManager}


def get_all2all_manager(group: GroupCoordinator, num_experts: int,
                        backend: str = "all_to_all_single") -> All2AllManagerBase:
    """The dispatch/combine manager of `backend` over EP group `group`."""
    if backend not in _BACKENDS:
        raise ValueError(f"all2all backend {backend!r} is unknown; known: {', '.join(_BACKENDS)}")
    return _BACKENDS[backend](group, num_experts)


__all__ = ["All2AllManager", "All2AllManagerBase", "DispatchHandle", "combine_topk", "get_all2all_manager"]
