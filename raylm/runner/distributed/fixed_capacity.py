"""Expert-parallel dispatch and combine through buffers of a fixed per-rank capacity (the low-latency mode of
DeepEP-style kernels): every shape follows from the capacity, the counts stay on the device, and nothing is read back
to the host, so a decode step that exchanges tokens between EP ranks can be captured in a CUDA graph.

Capacity C: the most tokens any EP rank routes in this forward, known on every rank from the step's
`num_tokens_across_dp` (`dispatch_capacity`). Each rank sends each destination rank a [C, H] buffer in
which slot s holds its s-th token routed to an expert there: one send per (token, destination rank), however many
of the token's k experts live on that rank, plus a [C, m] table of those experts' local ids (m = min(k, experts per
rank), -1 for none). The destination runs every (slot, expert) pair of the W x C x m it received through the grouped
expert matmul (empty slots and -1 entries are sorted past the last expert and never computed) and sends back, per
slot, the m outputs unweighted; the source picks each of its (token, choice) outputs and sums them with the router
weights in top-k order in float32, as the variable-size exchange (all2all.py) does: the same arithmetic, the same
tokens. The variable-size exchange stays for every other forward (prefill, mixed and eager batches), where padding
every rank to the largest would cost more than the exchange of counts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from raylm.runner.batch_descriptor import CUDAGraphMode
from raylm.runner.distributed.all2all import all_to_all, combine_topk
from raylm.runner.forward_context import current_forward_context
from raylm.runner.group_coordinator import GroupCoordinator


def dispatch_capacity(num_tokens: int, tp_size: int) -> int | None:
    """The per-rank capacity of this forward's fixed-capacity exchange, or None where it takes the variable-size one:
    fixed in a forward planned as a FULL CUDA graph (a uniform decode batch every DP rank runs at the same padded
    size, `num_tokens_across_dp`), a replay or its eager twin (an idle rank's dummy batch, a step past the graph's
    capacity), so every EP rank takes the same path and makes the same collectives. `num_tokens`: this rank's tokens
    in the forward (or micro-batch), of which each of the `tp_size` TP ranks routes a slice."""
    context = current_forward_context()
    if context is None or context.batch_descriptor is None:
        return None
    plan = context.batch_descriptor
    if plan.cudagraph_mode != CUDAGraphMode.FULL:
        return None
    # A micro-batch's size is the same on every rank: the ranks were padded alike before the cut.
    largest = context.num_tokens if plan.should_ubatch else max(plan.num_tokens_across_dp or [context.num_tokens])
    assert num_tokens <= largest, f"{num_tokens} tokens in a forward planned for at most {largest} per DP rank"
    return -(-largest // tp_size)


@dataclass
class FixedCapacityHandle:
    """Where each of this rank's (token, choice) pairs went, for combine."""

    rows: torch.Tensor  # [T, k] row of the W x C returned buffer holding the pair (destination * C + slot)
    ordinals: torch.Tensor  # [T, k] the pair's column among its token's experts on that rank
    topk_weights: torch.Tensor  # [T, k] float32
    send_counts: torch.Tensor  # [W] tokens sent to each rank, on the device


class FixedCapacityAll2All:
    def __init__(self, group: GroupCoordinator, num_experts: int, top_k: int) -> None:
        if num_experts % group.world_size:
            raise ValueError(f"enable_expert_parallel: {num_experts} experts cannot be split evenly over "
                             f"{group.world_size} expert-parallel ranks")
        self.group = group
        self.num_local_experts = num_experts // group.world_size
        self.experts_per_rank = min(top_k, self.num_local_experts)  # m: a token's experts on one rank, at most

    def dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 capacity: int) -> tuple[torch.Tensor, torch.Tensor, FixedCapacityHandle]:
        """hidden_states [T, H] (T <= capacity), topk_ids / topk_weights [T, k] (global expert ids) -> (the W x C
        rows received [W * C, H], the local expert ids of each row's pairs [W * C, m] (-1: none), a handle)."""
        num_tokens, hidden = hidden_states.shape
        assert num_tokens <= capacity, f"{num_tokens} tokens past the dispatch capacity {capacity}"
        world, m, device = self.group.world_size, self.experts_per_rank, hidden_states.device
        destinations = topk_ids // self.num_local_experts  # [T, k]
        needed = torch.zeros(num_tokens, world, dtype=torch.bool, device=device).scatter_(1, destinations, True)
        slots = needed.long().cumsum(0) - 1  # [T, W]: the token's slot in each destination's buffer
        # Row W * C of the send buffers takes the (token, rank) pairs that send nothing; it is never sent.
        send_rows = torch.where(needed, torch.arange(world, device=device) * capacity + slots, world * capacity)
        send = hidden_states.new_zeros(world * capacity + 1, hidden)
        send.index_copy_(0, send_rows.flatten(), hidden_states.repeat_interleave(world, dim=0))

        top_k = topk_ids.shape[1]
        # A choice's column on its destination: how many of the token's earlier choices went to the same rank.
        earlier = torch.ones(top_k, top_k, dtype=torch.bool, device=device).tril_(-1)
        ordinals = ((destinations[:, :, None] == destinations[:, None, :]) & earlier).sum(-1)
        rows = destinations * capacity + slots.gather(1, destinations)  # [T, k]
        experts = torch.full((world * capacity + 1, m), -1, dtype=torch.int64, device=device)
        experts.index_put_((rows.flatten(), ordinals.flatten()), (topk_ids % self.num_local_experts).flatten())

        received = all_to_all(self.group, send[:world * capacity])
        received_experts = all_to_all(self.group, experts[:world * capacity], overlap=False)
        handle = FixedCapacityHandle(rows, ordinals, topk_weights.float(), needed.sum(0))
        return received, received_experts, handle

    def combine(self, expert_output: torch.Tensor, handle: FixedCapacityHandle) -> torch.Tensor:
        """Outputs [W * C * m, H] of the pairs dispatch returned, in their order (-1 pairs: anything) -> this rank's
        tokens [T, H], weighted and summed."""
        hidden = expert_output.shape[-1]
        returned = all_to_all(self.group, expert_output.view(-1, self.experts_per_rank * hidden))
        pair_outputs = returned.view(-1, self.experts_per_rank, hidden)[handle.rows, handle.ordinals]  # [T, k, H]
        return combine_topk(pair_outputs, handle.topk_weights)
