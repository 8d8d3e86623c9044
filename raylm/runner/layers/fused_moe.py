"""FusedMoE: top-k routing, the experts' MLPs as one grouped matmul per expert, and the weighted combine.

Expert weights are stacked per projection: w13_weight [E_local, 2 * I, H] (gate rows, then up rows) and w2_weight
[E_local, H, I]. Without expert parallel (EP group of one) every rank holds every expert, each TP-sharded along I,
and the partial outputs are all-reduced over TP like RowParallelLinear. With expert parallel, EP rank r holds the
full weights of experts [r * E_local, (r + 1) * E_local); each TP rank routes a contiguous slice of the (replicated)
tokens through the all_to_all, and the slices are all-gathered over TP afterwards.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from raylm.runner.distributed import combine_topk, get_all2all_manager
from raylm.runner.distributed.fixed_capacity import FixedCapacityAll2All, dispatch_capacity
from raylm.runner.group_coordinator import GroupCoordinator
from raylm.runner.layers.activation import SiluAndMul
from raylm.runner.layers.linear import set_weight_loader
from raylm.runner.parallel_state import get_ep_group, get_tp_group

if TYPE_CHECKING:
    from raylm.runner.layers.quantization.ggml_blocks import QuantizedTensor

# [T, E] router logits -> (topk_weights [T, k] float32, topk_ids [T, k]): a model's own routing (DeepSeek's groups).
Routing = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

# An expert's checkpoint weight: per expert (`.experts.3.w1.weight`), or all experts fused in one tensor
# (`.experts.gate_up_proj` [E, 2I, H], `.experts.down_proj` [E, H, I]: transformers 5's layout in memory, written
# by save_pretrained(save_original_format=False)).
_EXPERT_WEIGHT = re.compile(r"\.experts\.(?:(\d+)\.(\w+)\.weight|(gate_up_proj|down_proj))$")


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] router logits -> (topk_weights [T, k] float32, topk_ids [T, k]): softmax in float32, then top-k, then
    (if renormalize) the k weights scaled to sum to one, as transformers' Mixtral and Qwen3-MoE routers do."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    topk_weights, topk_ids = probs.topk(top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def grouped_expert_mlp(x: torch.Tensor, expert_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                       act_fn: Callable[[torch.Tensor], torch.Tensor], row_index: torch.Tensor | None = None,
                       w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Row p of the result is expert `expert_ids[p]`'s MLP applied to `x[row_index[p]]` (row_index None: x[p]),
    unweighted, with the expert's biases ([E, 2I], [E, H]) where given; zero where the id is -1 (no expert: a
    fixed-capacity exchange's empty pair). The rows are sorted by
    expert (-1 last) and each projection is one grouped matmul over the experts' row ranges, whose ends stay on the
    device: on CUDA in bfloat16 (Hopper, Blackwell) one kernel with no host sync, so a CUDA graph can hold it;
    elsewhere torch runs one matmul per expert. Rows past the last range are never computed."""
    num_experts = w13.shape[0]
    no_expert = expert_ids < 0
    expert_ids = expert_ids.masked_fill(no_expert, num_experts)
    order = expert_ids.argsort(stable=True)
    sorted_rows = x[order if row_index is None else row_index[order]]
    # scatter_add rather than bincount, whose output size (the largest id) is read back to the host.
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, expert_ids, torch.ones_like(expert_ids, dtype=torch.int32))
    ends = counts[:num_experts].cumsum(0, dtype=torch.int32)
    hidden = F.grouped_mm(sorted_rows, w13.transpose(1, 2), offs=ends)  # weights [E, N, K] as column-major [E, K, N]
    # Each row's expert for its biases; the -1 rows (never computed, zeroed below) take the last expert's.
    sorted_ids = expert_ids[order].clamp_(max=num_experts - 1)
    if w13_bias is not None:
        hidden = hidden + w13_bias[sorted_ids]
    out_sorted = F.grouped_mm(act_fn(hidden), w2.transpose(1, 2), offs=ends)
    if w2_bias is not None:
        out_sorted = out_sorted + w2_bias[sorted_ids]
    out = torch.empty_like(out_sorted)
    out[order] = out_sorted
    return out.masked_fill_(no_expert[:, None], 0)


def why_grouped_mm_syncs(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why grouped_expert_mlp reads back to the host on `device` in `dtype` (None: it does not): torch's grouped
    matmul kernel takes bfloat16 on CUDA devices of compute capability 9 and 10; its fallback copies the ends to
    the host."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return f"the experts' grouped matmul runs as one kernel only in bfloat16 on CUDA (here: {device}, {dtype})"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return (f"the experts' grouped matmul runs as one kernel on compute capability 9.x or 10.x (here: "
                f"{major}.{minor})")
    return None


def token_slices(num_tokens: int, num_slices: int) -> list[int]:
    """Sizes of `num_slices` contiguous slices of `num_tokens`, as even as possible (the first ones one larger)."""
    return [num_tokens // num_slices + (i < num_tokens % num_slices) for i in range(num_slices)]


def all_gather_slices(part: torch.Tensor, sizes: list[int], group: GroupCoordinator) -> torch.Tensor:
    """Concatenate every rank's `part` (rank i's has sizes[i] rows, possibly none) in group order. Parts are padded
    to one size (at least one row), so every rank joins the same all_gather."""
    if group.world_size == 1:
        return part
    padded = part.new_zeros(max(1, max(sizes)), part.shape[1])
    padded[:part.shape[0]] = part
    gathered = group.all_gather(padded, dim=0).view(group.world_size, padded.shape[0], part.shape[1])
    return torch.cat([gathered[rank, :size] for rank, size in enumerate(sizes)])


class FusedMoE(nn.Module):
    """The routed experts of one MoE layer: forward(hidden_states [T, H], router_logits [T, E]) -> [T, H], complete
    on every TP rank."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool = True, hidden_act: str = "silu", routing: Routing | None = None) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act: {hidden_act!r} is unsupported for experts; only 'silu' is supported")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok: {top_k} must be between 1 and the number of experts "
                             f"({num_experts})")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.routing: Routing = routing or (lambda logits: select_experts(logits, top_k, renormalize))
        self.hidden_size = hidden_size
        self.tp_group, ep_group = get_tp_group(), get_ep_group()
        self.use_ep = ep_group.world_size > 1
        if self.use_ep:  # full experts, split over the EP ranks
            self.all2all = get_all2all_manager(ep_group, num_experts)  # prefill, mixed and eager batches
            self.fixed_all2all = FixedCapacityAll2All(ep_group, num_experts, top_k)  # FULL-graph decodes
            self.local_num_experts = self.all2all.num_local_experts
            self.expert_start = ep_group.rank_in_group * self.local_num_experts
            self.shard_rank, num_shards = 0, 1
        else:  # every expert, each TP-sharded along the intermediate dimension
            self.local_num_experts, self.expert_start = num_experts, 0
            self.shard_rank, num_shards = self.tp_group.rank_in_group, self.tp_group.world_size
            if intermediate_size % num_shards:
                raise ValueError(f"the experts' intermediate size {intermediate_size} (moe_intermediate_size, or "
                                 f"intermediate_size for Mixtral) is not divisible by tensor_parallel_size="
                                 f"{num_shards}; enable_expert_parallel keeps experts whole")
        self.intermediate_size = intermediate_size
        self.intermediate_size_per_partition = intermediate_size // num_shards
        self.act_fn = SiluAndMul()
        self.create_weights()

    def create_weights(self) -> None:
        """The local experts' stacked weights, this rank's shard of I: w13_weight [E_local, 2 * I_shard, H] and
        w2_weight [E_local, H, I_shard] (a model with other expert parameters overrides this and expert_mlp)."""
        shard, hidden_size = self.intermediate_size_per_partition, self.hidden_size
        self.w13_weight = set_weight_loader(
            nn.Parameter(torch.empty(self.local_num_experts, 2 * shard, hidden_size), requires_grad=False),
            self.weight_loader)
        self.w2_weight = set_weight_loader(
            nn.Parameter(torch.empty(self.local_num_experts, hidden_size, shard), requires_grad=False),
            self.weight_loader)

    def expert_mlp(self, x: torch.Tensor, expert_ids: torch.Tensor,
                   row_index: torch.Tensor | None = None) -> torch.Tensor:
        """grouped_expert_mlp over the local experts (ids local, -1 for none)."""
        return grouped_expert_mlp(x, expert_ids, self.w13_weight, self.w2_weight, self.act_fn, row_index)

    @staticmethod
    def make_expert_params_mapping(num_experts: int, gate_proj: str, down_proj: str,
                                   up_proj: str) -> list[tuple[str, str, tuple[int, str]]]:
        """(parameter name part, checkpoint name part, (expert id, "w1"|"w2"|"w3")) of every per-expert weight, for
        LlamaForCausalLM.load_weights; w1 is the gate projection, w3 the up projection, w2 the down projection."""
        return [(".experts.w2_weight" if shard == "w2" else ".experts.w13_weight", f".experts.{expert}.{name}.weight",
                 (expert, shard))
                for expert in range(num_experts)
                for shard, name in (("w1", gate_proj), ("w2", down_proj), ("w3", up_proj))]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        """Copy one expert's full checkpoint projection into its slot; another EP rank's expert is skipped."""
        assert isinstance(shard_id, tuple), f"expert weights load per expert, got shard {shard_id!r}"
        expert, proj = shard_id
        local = expert - self.expert_start
        full = (self.intermediate_size, self.hidden_size) if proj in ("w1", "w3") else (self.hidden_size,
                                                                                        self.intermediate_size)
        if tuple(loaded_weight.shape) != full:
            raise ValueError(f"expert {expert} {proj}: checkpoint tensor of shape {tuple(loaded_weight.shape)}, "
                             f"expected {full} from hidden_size and the moe intermediate size")
        if not 0 <= local < self.local_num_experts:
            return
        shard = self.intermediate_size_per_partition
        if proj == "w2":
            param.data[local].copy_(loaded_weight.narrow(1, self.shard_rank * shard, shard))
        else:
            offset = 0 if proj == "w1" else shard
            param.data[local, offset:offset + shard].copy_(loaded_weight.narrow(0, self.shard_rank * shard, shard))

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if self.use_ep:
            return self._forward_expert_parallel(hidden_states, router_logits)
        topk_weights, topk_ids = self.routing(router_logits)
        pair_rows = torch.arange(topk_ids.numel(), device=topk_ids.device) // self.top_k
        out = self.expert_mlp(hidden_states, topk_ids.flatten(), pair_rows)
        out = combine_topk(out.view(*topk_ids.shape, self.hidden_size), topk_weights)
        return self.tp_group.all_reduce(out)

    def _forward_expert_parallel(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        # Every TP rank holds all the tokens; each routes only its slice, so no pair is computed twice.
        sizes = token_slices(hidden_states.shape[0], self.tp_group.world_size)
        start = sum(sizes[:self.tp_group.rank_in_group])
        end = start + sizes[self.tp_group.rank_in_group]
        topk_weights, topk_ids = self.routing(router_logits[start:end])
        capacity = dispatch_capacity(hidden_states.shape[0], self.tp_group.world_size)
        if capacity is None:
            rows, expert_ids, handle = self.all2all.dispatch(hidden_states[start:end], topk_ids, topk_weights)
            expert_output = self.expert_mlp(rows, expert_ids)
            combined = self.all2all.combine(expert_output, handle)
        else:
            rows, experts, fixed = self.fixed_all2all.dispatch(hidden_states[start:end], topk_ids, topk_weights,
                                                               capacity)
            pair_rows = torch.arange(experts.numel(), device=rows.device) // experts.shape[1]
            expert_output = self.expert_mlp(rows, experts.flatten(), pair_rows)
            combined = self.fixed_all2all.combine(expert_output, fixed)
        return all_gather_slices(combined, sizes, self.tp_group)

    def extra_repr(self) -> str:
        return (f"experts={self.local_num_experts}/{self.num_experts} (from {self.expert_start}), top_k={self.top_k}, "
                f"intermediate={self.intermediate_size_per_partition}, expert_parallel={self.use_ep}")


def expand_expert_weights(weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]], num_experts: int,
                          gate_proj: str, down_proj: str, up_proj: str
                          ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Pass checkpoint weights through, with every expert weight in the per-expert layout: fused gate_up_proj /
    down_proj tensors are split per expert. An expert weight of an unknown name or expert id raises ValueError."""
    names = (gate_proj, down_proj, up_proj)
    for name, tensor in weights:
        match = _EXPERT_WEIGHT.search(name) if ".experts." in name else None
        if ".experts." in name and match is None:
            raise ValueError(f"checkpoint weight {name!r} is not an expert weight this model knows: expected "
                             f"'.experts.<id>.<{'|'.join(names)}>.weight' or '.experts.gate_up_proj|down_proj'")
        if match is None:
            yield name, tensor
            continue
        prefix = name[:match.start()]
        if match[1] is not None:
            expert, proj = int(match[1]), match[2]
            if proj not in names:
                raise ValueError(f"checkpoint weight {name!r}: unknown expert projection {proj!r}; expected one of "
                                 f"{', '.join(names)}")
            if expert >= num_experts:
                raise ValueError(f"checkpoint weight {name!r}: expert {expert} is out of range for the config's "
                                 f"{num_experts} experts")
            yield name, tensor
            continue
        assert isinstance(tensor, torch.Tensor)  # packed blocks (QuantizedTensor) are a linear's `.weight` only
        if tensor.dim() != 3 or tensor.shape[0] != num_experts:
            raise ValueError(f"checkpoint weight {name!r} of shape {tuple(tensor.shape)}: expected "
                             f"[{num_experts}, ...] for the config's {num_experts} experts")
        for expert in range(num_experts):
            if match[3] == "down_proj":
                yield f"{prefix}.experts.{expert}.{down_proj}.weight", tensor[expert]
            else:
                gate, up = tensor[expert].chunk(2)
                yield f"{prefix}.experts.{expert}.{gate_proj}.weight", gate
                yield f"{prefix}.experts.{expert}.{up_proj}.weight", up
