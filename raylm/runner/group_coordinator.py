"""GroupCoordinator: one process group of the parallel layout, and the collectives the model and worker use.

Tensors travel over the device group (NCCL on CUDA, gloo on CPU). Python objects (the keys, shapes and dtypes that a
receiver needs before it can post its tensor receives) travel over a gloo CPU group beside it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# (key, dtype, shape) of each tensor of a dict, in send order.
TensorMetadata = list[tuple[str, torch.dtype, tuple[int, ...]]]


@dataclass
class GroupCoordinator:
    ranks: list[int]  # global ranks of the group, in group order
    rank_in_group: int
    device_group: dist.ProcessGroup | None = None  # None exactly when the group has one rank
    cpu_group: dist.ProcessGroup | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # recv_tensor_dict writes into these, grown to the largest message seen, so that steps reuse the same memory
    # (and a CUDA graph replayed on them sees the same addresses).
    _recv_buffers: dict[str, torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    # cpu_all_reduce calls completed: what a test counts to see that a rank joined a collective, not only meant to.
    num_cpu_all_reduces: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        assert 0 <= self.rank_in_group < len(self.ranks)
        assert (self.device_group is None) == (self.world_size == 1), "a group of >1 ranks needs a process group"
        assert (self.cpu_group is None) == (self.device_group is None)

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

    def cpu_all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of a small CPU tensor over the gloo CPU group (no device sync), in place; returns `tensor`."""
        assert self.cpu_group is not None, "a group of one has nothing to reduce"
        dist.all_reduce(tensor, group=self.cpu_group)
        self.num_cpu_all_reduces += 1
        return tensor

    def any_true(self, flag: bool) -> bool:
        """Whether `flag` is set on any rank of the group: a small all-reduce over the CPU group."""
        if self.world_size == 1:
            return flag
        value = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return bool(value.item())

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenation of every rank's `tensor` along `dim`, in group order."""
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def send_tensor_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Send `tensors` to the next rank of the group: the metadata over the CPU group, then each tensor over the
        device group."""
        assert self.world_size > 1, "send_tensor_dict needs a peer"
        metadata: TensorMetadata = [(key, t.dtype, tuple(t.shape)) for key, t in tensors.items()]
        dist.send_object_list([metadata], dst=self.next_rank, group=self.cpu_group)
        for tensor in tensors.values():
            dist.send(tensor.contiguous(), dst=self.next_rank, group=self.device_group)

    def recv_tensor_dict(self) -> dict[str, torch.Tensor]:
        """What the previous rank sent with send_tensor_dict. The tensors are views of persistent buffers: the next
        call overwrites them."""
        assert self.world_size > 1, "recv_tensor_dict needs a peer"
        box: list[TensorMetadata | None] = [None]
        dist.recv_object_list(box, src=self.prev_rank, group=self.cpu_group)
        assert box[0] is not None
        tensors = {}
        for key, dtype, shape in box[0]:
            tensors[key] = self._recv_buffer(key, dtype, shape)
            dist.recv(tensors[key], src=self.prev_rank, group=self.device_group)
        return tensors

    def _recv_buffer(self, key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        numel = math.prod(shape)
        buffer = self._recv_buffers.get(key)
        if buffer is None or buffer.dtype != dtype or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=self.device)
            self._recv_buffers[key] = buffer
        return buffer[:numel].view(shape)
