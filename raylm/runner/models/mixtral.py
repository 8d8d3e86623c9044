"""Mixtral: Llama attention with a sparse MoE feed-forward in every layer (softmax router, top-k, renormalised)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from raylm.runner.layers.fused_moe import FusedMoE, expand_expert_weights
from raylm.runner.models.llama import LlamaDecoderLayer, LlamaForCausalLM, ShardId

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from raylm.runner.layers.quantization.ggml_blocks import QuantizedTensor


class MixtralMoE(nn.Module):
    """Router (a replicated linear layer) and the routed experts."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 hidden_act: str = "silu") -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize, hidden_act)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.gate(hidden_states))


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return MixtralMoE(config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
                          config.intermediate_size, renormalize=True, hidden_act=config.hidden_act)


class MixtralForCausalLM(LlamaForCausalLM):
    """Expert weights load per expert (`experts.<id>.w1.weight`, ...) or fused (`experts.gate_up_proj`, ...), both
    stacked into FusedMoE's w13_weight / w2_weight."""

    layer_type: ClassVar[type[LlamaDecoderLayer]] = MixtralDecoderLayer
    # Checkpoint names of an expert's gate, down and up projections.
    expert_names: ClassVar[tuple[str, str, str]] = ("w1", "w2", "w3")

    def __init__(self, config: PretrainedConfig, pp_rank: int = 0, pp_size: int = 1,
                 partition: list[int] | None = None) -> None:
        if getattr(config, "sliding_window", None) is not None:
            raise ValueError(f"sliding_window: {config.sliding_window}; sliding-window attention is not supported")
        super().__init__(config, pp_rank, pp_size, partition)

    @property
    def num_experts(self) -> int:
        return self.config.num_local_experts

    def get_expert_mapping(self) -> list[tuple[str, str, ShardId]]:
        return FusedMoE.make_expert_params_mapping(self.num_experts, *self.expert_names)  # type: ignore[return-value]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> set[str]:
        # Our MoE block is `mlp` (transformers 5's in-memory name); Mixtral checkpoints call it `block_sparse_moe`.
        renamed = ((name.replace(".block_sparse_moe.", ".mlp."), tensor) for name, tensor in weights)
        return super().load_weights(expand_expert_weights(renamed, self.num_experts, *self.expert_names))
