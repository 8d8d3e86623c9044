"""The process groups of a parallel world: tensor (TP), pipeline (PP), data (DP) and expert (EP) parallel.

Global rank = dp * (PP * TP) + pp * TP + tp. TP is innermost, so a TP group is a run of consecutive ranks and the
executor can keep it on one node. EP spans DP x TP within one PP stage (for MoE models with expert parallel; without
it each rank is its own EP group and MoE layers shard every expert by TP).

DP ranks share one torch.distributed world only when they step in lock-step (MoE with expert parallel); independent
DP engines each have a world of their own, where the DP size is 1.

A world of one needs no torch.distributed: every collective is then the identity. A larger one needs
`init_distributed_environment` first; every rank then creates every group, in the same order, as
`dist.new_group` requires.
"""
from __future__ import annotations

from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from raylm.common.parallel_layout import RankLayout
from raylm.runner.group_coordinator import GroupCoordinator

_STORE_TIMEOUT = timedelta(minutes=10)  # every rank must have loaded its model by then


_TP: GroupCoordinator | None = None
_PP: GroupCoordinator | None = None
_DP: GroupCoordinator | None = None
_EP: GroupCoordinator | None = None


def init_distributed_environment(world_size: int, rank: int, init_method: str | None, backend: str,
                                 store_elsewhere: bool = False) -> None:
    """Join the default process group (nothing to join for a world of one). `init_method` tcp://host:port names a
    store that rank 0's process hosts, or, with `store_elsewhere`, one another process hosts (lock-step DP engines:
    the first engine's), which every rank then joins as a client."""
    if world_size <= 1 or dist.is_initialized():
        return
    if not store_elsewhere:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
        return
    address = urlparse(init_method)
    assert address.scheme == "tcp" and address.hostname and address.port, f"not a tcp://host:port: {init_method}"
    store = dist.TCPStore(address.hostname, address.port, is_master=False, timeout=_STORE_TIMEOUT)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)


def init_model_parallel(tp_size: int = 1, pp_size: int = 1, dp_size: int = 1, enable_expert_parallel: bool = False,
                        backend: str | None = None) -> None:
    """Create this process's TP, PP, DP and EP groups (`backend` None: the default group's). Calling it again with
    the same sizes is a no-op."""
    global _TP, _PP, _DP, _EP
    layout = RankLayout(tp_size, pp_size, dp_size)
    if _TP is not None:
        current = RankLayout(_TP.world_size, get_pp_group().world_size, get_dp_group().world_size)
        if current != layout or (get_ep_group().world_size > 1) != (enable_expert_parallel and layout.ep_size > 1):
            raise RuntimeError(f"model parallel already initialised as {current}; asked for {layout} "
                               f"(call destroy_model_parallel first)")
        return
    if layout.world_size == 1:
        _TP, _PP, _DP, _EP = (GroupCoordinator([0], 0) for _ in range(4))
        return
    if not dist.is_initialized():
        raise RuntimeError(f"{layout} needs init_distributed_environment first")
    if dist.get_world_size() != layout.world_size:
        raise RuntimeError(f"torch.distributed world size is {dist.get_world_size()}, but {layout} has "
                           f"{layout.world_size} ranks")
    backend = backend or dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    groups: dict[tuple[int, ...], tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}
    _TP = _make_group(layout.tp_groups(), backend, device, groups)
    _PP = _make_group(layout.pp_groups(), backend, device, groups)
    _DP = _make_group(layout.dp_groups(), backend, device, groups)
    ep_groups = layout.ep_groups() if enable_expert_parallel else [[rank] for rank in range(layout.world_size)]
    _EP = _make_group(ep_groups, backend, device, groups)


def _make_group(group_ranks: list[list[int]], backend: str, device: torch.device,
                groups: dict[tuple[int, ...], tuple[dist.ProcessGroup, dist.ProcessGroup]]) -> GroupCoordinator:
    """This rank's group among `group_ranks`. `groups` caches process groups by member list, so a group equal to one
    made before (EP = TP when DP is 1) costs no new communicator."""
    rank = dist.get_rank()
    mine: GroupCoordinator | None = None
    for ranks in group_ranks:
        device_group = cpu_group = None
        if len(ranks) > 1:
            if tuple(ranks) not in groups:
                device_group = dist.new_group(ranks, backend=backend)
                cpu_group = device_group if backend == "gloo" else dist.new_group(ranks, backend="gloo")
                groups[tuple(ranks)] = device_group, cpu_group
            device_group, cpu_group = groups[tuple(ranks)]
        if rank in ranks:
            mine = GroupCoordinator(ranks, ranks.index(rank), device_group, cpu_group, device)
    assert mine is not None, f"rank {rank} is in none of the groups {group_ranks}"
    return mine


def destroy_model_parallel() -> None:
    """Forget the groups (the process groups themselves go with `dist.destroy_process_group`)."""
    global _TP, _PP, _DP, _EP
    _TP = _PP = _DP = _EP = None


def model_parallel_is_initialized() -> bool:
    return _TP is not None


def get_tp_group() -> GroupCoordinator:
    assert _TP is not None, "tensor parallel group is not initialised: call init_model_parallel first"
    return _TP


def get_pp_group() -> GroupCoordinator:
    assert _PP is not None, "pipeline parallel group is not initialised: call init_model_parallel first"
    return _PP


def get_dp_group() -> GroupCoordinator:
    assert _DP is not None, "data parallel group is not initialised: call init_model_parallel first"
    return _DP


def get_ep_group() -> GroupCoordinator:
    assert _EP is not None, "expert parallel group is not initialised: call init_model_parallel first"
    return _EP
