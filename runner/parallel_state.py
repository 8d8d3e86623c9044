"""Tensor- and pipeline-parallel process groups of one engine.

Global rank = pp_rank * TP + tp_rank (TP innermost). A world of one needs no torch.distributed: every
collective is then the identity. With more ranks, the caller initialises the default process group
first; every rank then creates every group, in the same order, as `dist.new_group` requires.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class GroupCoordinator:
    ranks: list[int]  # global ranks of the group, in group order
    rank_in_group: int
    device_group: dist.ProcessGroup | None = None  # None exactly when the group has one rank
    cpu_group: dist.ProcessGroup | None = None  # gloo, for metadata (objects) next to device tensors

    def __post_init__(self) -> None:
        assert 0 <= self.rank_in_group < len(self.ranks)
        assert (self.device_group is None) == (self.world_size == 1), "a group of >1 ranks needs a process group"

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        return self.ranks[self.rank_in_group]

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def next_rank(self) -> int:
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place; returns `tensor`."""
        if self.world_size > 1:
            dist.all_reduce(tensor, group=self.device_group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenation of every rank's `tensor` along `dim`, in group order."""
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)


_TP: GroupCoordinator | None = None
_PP: GroupCoordinator | None = None


def _make_groups(group_ranks: list[list[int]], rank: int, backend: str | None) -> GroupCoordinator:
    mine: GroupCoordinator | None = None
    for ranks in group_ranks:
        device_group = cpu_group = None
        if len(ranks) > 1:
            device_group = dist.new_group(ranks, backend=backend)
            cpu_group = device_group if dist.get_backend(device_group) == "gloo" else dist.new_group(
                ranks, backend="gloo")
        if rank in ranks:
            mine = GroupCoordinator(ranks, ranks.index(rank), device_group, cpu_group)
    assert mine is not None, f"rank {rank} is in none of the groups {group_ranks}"
    return mine


def init_model_parallel(tp_size: int = 1, pp_size: int = 1, backend: str | None = None) -> None:
    """Create the TP and PP groups of this process. A world of one rank needs no torch.distributed (and uses
    none even when it is initialised); a larger one needs `dist.init_process_group` first (`backend` None: the
    default group's backend). Calling it again with the same sizes is a no-op."""
    global _TP, _PP
    if _TP is not None and _PP is not None:
        if (_TP.world_size, _PP.world_size) != (tp_size, pp_size):
            raise RuntimeError(f"model parallel already initialised with tp={_TP.world_size}, pp={_PP.world_size}; "
                               f"asked for tp={tp_size}, pp={pp_size} (call destroy_model_parallel first)")
        return
    world_size = tp_size * pp_size
    if world_size == 1:
        _TP, _PP = GroupCoordinator([0], 0), GroupCoordinator([0], 0)
        return
    if not dist.is_initialized():
        raise RuntimeError(f"tp={tp_size} x pp={pp_size} needs torch.distributed.init_process_group first")
    if dist.get_world_size() != world_size:
        raise RuntimeError(f"torch.distributed world size is {dist.get_world_size()}, but tp={tp_size} x "
                           f"pp={pp_size} = {world_size}")
    rank = dist.get_rank()
    _TP = _make_groups([[pp * tp_size + tp for tp in range(tp_size)] for pp in range(pp_size)], rank, backend)
    _PP = _make_groups([[pp * tp_size + tp for pp in range(pp_size)] for tp in range(tp_size)], rank, backend)


def destroy_model_parallel() -> None:
    """Forget the groups (the process groups themselves go with `dist.destroy_process_group`)."""
    global _TP, _PP
    _TP = _PP = None


def model_parallel_is_initialized() -> bool:
    return _TP is not None and _PP is not None


def get_tp_group() -> GroupCoordinator:
    assert _TP is not None, "tensor parallel group is not initialised: call init_model_parallel first"
    return _TP


def get_pp_group() -> GroupCoordinator:
    assert _PP is not None, "pipeline parallel group is not initialised: call init_model_parallel first"
    return _PP


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank_in_group


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size


def tensor_model_parallel_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    return get_tp_group().all_reduce(tensor)


def tensor_model_parallel_all_gather(tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return get_tp_group().all_gather(tensor, dim)
