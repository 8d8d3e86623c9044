"""GPT-OSS's mixture of experts: a router with a bias, top-k of its logits then a softmax over those k, and experts
whose projections have biases and whose activation is a clamped SwiGLU (transformers' GptOssExperts).

A FusedMoE with its own parameters and expert MLP, so tensor parallel and expert parallel (the variable-size and the
fixed-capacity all_to_all) run as for every MoE: a pair's biases are its expert's, and the rank holding the expert
adds them. The checkpoint stores all experts fused and transposed against nn.Linear: gate_up_proj [E, H, 2I] with the
gate and up columns interleaved (gate at even columns, up at odd), gate_up_proj_bias [E, 2I], down_proj [E, I, H],
down_proj_bias [E, H]. The loaders turn them into FusedMoE's layout, gate rows then up rows ([E_local, 2I, H] and
[E_local, H, I]): under TP each rank keeps its slice of I, the down bias adding on TP rank 0 only so the all-reduce
adds it once (as RowParallelLinear does); under EP each rank keeps its experts whole.
"""
from __future__ import annotations

import torch
from torch import nn

from raylm.runner.layers.fused_moe import FusedMoE, grouped_expert_mlp
from raylm.runner.layers.linear import set_weight_loader


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[N, 2I] gate then up -> [N, I]: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def select_experts_topk_softmax(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] -> (weights [T, k] float32, ids [T, k]): the k largest logits, then a softmax over those k alone."""
    topk_logits, topk_ids = router_logits.topk(top_k, dim=-1)
    return torch.softmax(topk_logits.float(), dim=-1), topk_ids


class GptOssExperts(FusedMoE):
    """forward(hidden_states [T, H], router_logits [T, E]) -> [T, H], complete on every TP rank."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, alpha: float,
                 limit: float) -> None:
        self.alpha, self.limit = alpha, limit
        super().__init__(num_experts, top_k, hidden_size, intermediate_size,
                         routing=lambda logits: select_experts_topk_softmax(logits, top_k))

    def create_weights(self) -> None:
        # Named as the checkpoint names them, so LlamaForCausalLM.load_weights finds them; the layout is FusedMoE's.
        experts, shard, hidden = self.local_num_experts, self.intermediate_size_per_partition, self.hidden_size
        self.gate_up_proj = self._param((experts, 2 * shard, hidden), self._load_gate_up)
        self.gate_up_proj_bias = self._param((experts, 2 * shard), self._load_gate_up)
        self.down_proj = self._param((experts, hidden, shard), self._load_down)
        self.down_proj_bias = self._param((experts, hidden), self._load_down)

    @staticmethod
    def _param(shape: tuple[int, ...], loader: object) -> nn.Parameter:
        return set_weight_loader(nn.Parameter(torch.empty(shape), requires_grad=False), loader)  # type: ignore[arg-type]

    def _local(self, loaded: torch.Tensor, expected: tuple[int, ...], name: str) -> torch.Tensor:
        """This rank's experts of a checkpoint tensor whose shape must be `expected`."""
        if tuple(loaded.shape) != expected:
            raise ValueError(f"experts.{name}: checkpoint tensor of shape {tuple(loaded.shape)}, expected {expected} "
                             f"from num_local_experts, hidden_size and intermediate_size")
        return loaded.narrow(0, self.expert_start, self.local_num_experts)

    def _load_gate_up(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """[E, H, 2I] weight or [E, 2I] bias, gate and up interleaved -> this rank's gate rows, then its up rows."""
        is_bias = param.dim() == 2
        expected = (self.num_experts, 2 * self.intermediate_size) if is_bias else (
            self.num_experts, self.hidden_size, 2 * self.intermediate_size)
        loaded = self._local(loaded, expected, "gate_up_proj_bias" if is_bias else "gate_up_proj")
        shard = self.intermediate_size_per_partition
        for half in (0, 1):  # gate at even columns, up at odd
            part = loaded[..., half::2].narrow(-1, self.shard_rank * shard, shard)
            param.data.narrow(1, half * shard, shard).copy_(part if is_bias else part.transpose(1, 2))

    def _load_down(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """[E, I, H] weight -> [E_local, H, I's slice]; [E, H] bias, this rank's experts whole."""
        if param.dim() == 2:
            param.data.copy_(self._local(loaded, (self.num_experts, self.hidden_size), "down_proj_bias"))
            return
        loaded = self._local(loaded, (self.num_experts, self.intermediate_size, self.hidden_size), "down_proj")
        shard = self.intermediate_size_per_partition
        param.data.copy_(loaded.narrow(1, self.shard_rank * shard, shard).transpose(1, 2))

    def expert_mlp(self, x: torch.Tensor, expert_ids: torch.Tensor,
                   row_index: torch.Tensor | None = None) -> torch.Tensor:
        down_bias = self.down_proj_bias if self.shard_rank == 0 else None  # one TP shard adds it (EP: shard 0)
        return grouped_expert_mlp(x, expert_ids, self.gate_up_proj, self.down_proj, self._activation, row_index,
                                  self.gate_up_proj_bias, down_bias)

    def _activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        return swiglu_oai(gate_up, self.alpha, self.limit)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, alpha={self.alpha}, limit={self.limit}"
