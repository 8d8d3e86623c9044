"""Expert-parallel dispatch and combine: send each (token, expert) pair to the EP rank that owns the expert, bring the
expert outputs back and sum them with the router weights.

Rank r of the EP group owns the global experts [r * E_local, (r + 1) * E_local). Every rank calls the same collectives
in the same order on every forward, whatever its token count (zero included): a rank that skipped one would hang the
others. Under dual batch overlap each exchange is an async collective that the other micro-batch's compute overlaps.
Managers are swappable (a DeepEP-like backend later) behind All2AllManagerBase.

This manager exchanges variable-size splits whose sizes it reads to the host: prefill and eager batches. A decode
step that replays a CUDA graph takes the fixed-capacity exchange instead (distributed/fixed_capacity.py).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.distributed as dist

from raylm.runner.group_coordinator import GroupCoordinator
from raylm.runner.ubatching import dbo_enabled, dbo_overlap


def combine_topk(pair_outputs: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """[T, k, H] expert outputs of each token's k experts -> [T, H] weighted sum, accumulated in float32 in top-k
    order (a loop over k, not tokens) so the result does not depend on how the pairs were grouped."""
    out = pair_outputs[:, 0].float() * topk_weights[:, :1]
    for j in range(1, pair_outputs.shape[1]):
        out = out + pair_outputs[:, j].float() * topk_weights[:, j:j + 1]
    return out.to(pair_outputs.dtype)


@dataclass
class DispatchHandle:
    """What combine needs to send the outputs back and put them in token order."""

    order: torch.Tensor  # [T * k]: the pair index (token * k + j) of each row sent, in send order
    send_counts: list[int]  # rows sent to each EP rank
    recv_counts: list[int]  # rows received from each EP rank
    topk_weights: torch.Tensor  # [T, k] float32


class All2AllManagerBase(ABC):
    def __init__(self, group: GroupCoordinator, num_experts: int) -> None:
        if num_experts % group.world_size:
            raise ValueError(f"enable_expert_parallel: {num_experts} experts cannot be split evenly over "
                             f"{group.world_size} expert-parallel ranks")
        self.group = group
        self.num_experts = num_experts
        self.num_local_experts = num_experts // group.world_size

    @abstractmethod
    def dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """hidden_states [T, H], topk_ids / topk_weights [T, k] (global expert ids) -> (rows this rank's experts
        must process [M, H], the local expert id of each row [M], a handle for combine)."""

    @abstractmethod
    def combine(self, expert_output: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Expert outputs [M, H] of the rows dispatch returned -> this rank's tokens [T, H], weighted and summed."""


class All2AllManager(All2AllManagerBase):
    """torch.distributed.all_to_all_single with split sizes over the EP group's device group (gloo on CPU, NCCL on
    CUDA). Two collectives per dispatch (per-expert counts, then rows) and one per combine; a token routed to k
    experts of one rank travels k times."""

    def dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        world, local = self.group.world_size, self.num_local_experts
        top_k = topk_ids.shape[1]
        flat_ids = topk_ids.flatten()
        # Sorting by global expert id groups the pairs by destination rank, and within it by local expert.
        order = flat_ids.argsort(stable=True)
        send_per_expert = torch.bincount(flat_ids, minlength=self.num_experts)
        # Row r of the result: how many rows rank r sends to each of this rank's experts.
        # A few integers: not worth a hand-off to the other micro-batch (the row exchanges below are).
        recv_per_expert = all_to_all(self.group, send_per_expert, overlap=False)
        counts = torch.stack([send_per_expert.view(world, local).sum(1), recv_per_expert.view(world, local).sum(1)])
        send_counts, recv_counts = counts.tolist()
        rows = hidden_states[order // top_k]
        received = all_to_all(self.group, rows, recv_counts, send_counts)
        expert_ids = torch.arange(local, device=flat_ids.device).repeat(world).repeat_interleave(recv_per_expert)
        return received, expert_ids, DispatchHandle(order, send_counts, recv_counts, topk_weights.float())

    def combine(self, expert_output: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        returned = all_to_all(self.group, expert_output, handle.send_counts, handle.recv_counts)
        pair_outputs = torch.empty_like(returned)
        pair_outputs[handle.order] = returned
        num_tokens, top_k = handle.topk_weights.shape
        return combine_topk(pair_outputs.view(num_tokens, top_k, returned.shape[1]), handle.topk_weights)


def all_to_all(group: GroupCoordinator, tensor: torch.Tensor, output_split_sizes: list[int] | None = None,
               input_split_sizes: list[int] | None = None, overlap: bool = True) -> torch.Tensor:
    """Rows of `tensor` split by `input_split_sizes` (None: evenly) to the group's ranks; the rows received, in rank
    order. A group of one has no process group: its only rank keeps everything. `overlap`: under dual batch overlap,
    run the other micro-batch while this exchange is in flight."""
    if group.world_size == 1:
        return tensor
    rows = tensor.shape[0] if output_split_sizes is None else sum(output_split_sizes)
    out = tensor.new_empty(rows, *tensor.shape[1:])
    if not (overlap and dbo_enabled()):
        dist.all_to_all_single(out, tensor.contiguous(), output_split_sizes, input_split_sizes,
                               group=group.device_group)
        return out
    # A micro-batch: the other one computes while this exchange is in flight (runner/ubatching.py).
    dbo_overlap(lambda: dist.all_to_all_single(out, tensor.contiguous(), output_split_sizes, input_split_sizes,
                                               group=group.device_group, async_op=True))
    return out
