"""GPT-OSS's mixture of experts: a router with a bias, top-k of its logits then a softmax over those k, and experts
whose projections have biases and whose activation is a clamped SwiGLU (transformers' GptOssExperts).

The checkpoint stores all experts fused and transposed against nn.Linear: gate_up_proj [E, H, 2I] with the gate and
up columns interleaved (gate at even columns, up at odd), gate_up_proj_bias [E, 2I], down_proj [E, I, H],
down_proj_bias [E, H]. The loaders turn them into FusedMoE's layout, gate rows then up rows ([E, 2I, H] and
[E, H, I]), each TP rank keeping its slice of I; the down bias joins on TP rank 0 only, so the all-reduce adds it
once (as RowParallelLinear does).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raylm.runner.distributed import combine_topk
from raylm.runner.layers.linear import set_weight_loader
from raylm.runner.parallel_state import get_ep_group, get_tp_group


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[N, 2I] gate then up -> [N, I]: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def select_experts_topk_softmax(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] -> (weights [T, k] float32, ids [T, k]): the k largest logits, then a softmax over those k alone."""
    topk_logits, topk_ids = router_logits.topk(top_k, dim=-1)
    return torch.softmax(topk_logits.float(), dim=-1), topk_ids


class GptOssExperts(nn.Module):
    """forward(hidden_states [T, H], router_logits [T, E]) -> [T, H], complete on every TP rank."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, alpha: float,
                 limit: float) -> None:
        super().__init__()
        if get_ep_group().world_size > 1:
            raise ValueError("enable_expert_parallel: GPT-OSS's experts (biases, clamped SwiGLU) run tensor parallel "
                             "only; turn expert parallel off")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok: {top_k} must be between 1 and num_local_experts ({num_experts})")
        self.tp_group = get_tp_group()
        tp_size, self.tp_rank = self.tp_group.world_size, self.tp_group.rank_in_group
        if intermediate_size % tp_size:
            raise ValueError(f"intermediate_size: {intermediate_size} is not divisible by tensor_parallel_size="
                             f"{tp_size}; GPT-OSS splits each expert's intermediate dimension over the TP ranks")
        self.num_experts, self.top_k, self.hidden_size = num_experts, top_k, hidden_size
        self.intermediate_size, self.alpha, self.limit = intermediate_size, alpha, limit
        shard = self.shard = intermediate_size // tp_size
        # Named as the checkpoint names them, so LlamaForCausalLM.load_weights finds them; the layout is FusedMoE's.
        self.gate_up_proj = self._param((num_experts, 2 * shard, hidden_size), self._load_gate_up)
        self.gate_up_proj_bias = self._param((num_experts, 2 * shard), self._load_gate_up)
        self.down_proj = self._param((num_experts, hidden_size, shard), self._load_down)
        self.down_proj_bias = self._param((num_experts, hidden_size), self._load_down)

    @staticmethod
    def _param(shape: tuple[int, ...], loader: object) -> nn.Parameter:
        return set_weight_loader(nn.Parameter(torch.empty(shape), requires_grad=False), loader)  # type: ignore[arg-type]

    def _check_shape(self, loaded: torch.Tensor, expected: tuple[int, ...], name: str) -> None:
        if tuple(loaded.shape) != expected:
            raise ValueError(f"experts.{name}: checkpoint tensor of shape {tuple(loaded.shape)}, expected {expected} "
                             f"from num_local_experts, hidden_size and intermediate_size")

    def _load_gate_up(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """[E, H, 2I] weight or [E, 2I] bias, gate and up interleaved -> this rank's gate rows, then its up rows."""
        is_bias = param.dim() == 2
        expected = (self.num_experts, 2 * self.intermediate_size) if is_bias else (
            self.num_experts, self.hidden_size, 2 * self.intermediate_size)
        self._check_shape(loaded, expected, "gate_up_proj_bias" if is_bias else "gate_up_proj")
        start = self.tp_rank * self.shard
        for half in (0, 1):  # gate at even columns, up at odd
            part = loaded[..., half::2].narrow(-1, start, self.shard)
            param.data.narrow(1, half * self.shard, self.shard).copy_(part if is_bias else part.transpose(1, 2))

    def _load_down(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """[E, I, H] weight -> [E, H, I's slice]; [E, H] bias, whole."""
        if param.dim() == 2:
            self._check_shape(loaded, (self.num_experts, self.hidden_size), "down_proj_bias")
            param.data.copy_(loaded)
            return
        self._check_shape(loaded, (self.num_experts, self.intermediate_size, self.hidden_size), "down_proj")
        param.data.copy_(loaded.narrow(1, self.tp_rank * self.shard, self.shard).transpose(1, 2))

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts_topk_softmax(router_logits, self.top_k)
        expert_ids = topk_ids.flatten()
        # Pairs sorted by expert, each projection one grouped matmul over the experts' row ranges (ends on the device:
        # no host read), the experts' biases gathered per row.
        order = expert_ids.argsort(stable=True)
        sorted_ids = expert_ids[order]
        rows = hidden_states[order // self.top_k]
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=rows.device)
        counts.scatter_add_(0, sorted_ids, torch.ones_like(sorted_ids, dtype=torch.int32))
        ends = counts.cumsum(0, dtype=torch.int32)
        gate_up = F.grouped_mm(rows, self.gate_up_proj.transpose(1, 2), offs=ends) + self.gate_up_proj_bias[sorted_ids]
        out_sorted = F.grouped_mm(swiglu_oai(gate_up, self.alpha, self.limit), self.down_proj.transpose(1, 2),
                                  offs=ends)
        if self.tp_rank == 0:
            out_sorted = out_sorted + self.down_proj_bias[sorted_ids]
        out = torch.empty_like(out_sorted)
        out[order] = out_sorted
        return self.tp_group.all_reduce(combine_topk(out.view(*topk_ids.shape, self.hidden_size), topk_weights))

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, intermediate={self.shard}, alpha={self.alpha}, "
                f"limit={self.limit}")
