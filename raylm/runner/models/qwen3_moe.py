"""Qwen3-MoE: Qwen3 attention (q/k RMSNorm) with a sparse MoE feed-forward (softmax router, top-k, renormalised only
if `norm_topk_prob`), or a dense MLP in layers listed in `mlp_only_layers` or off the `decoder_sparse_step` grid."""
from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from torch import nn

from raylm.runner.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
from raylm.runner.models.mixtral import MixtralForCausalLM, MixtralMoE
from raylm.runner.models.qwen3 import Qwen3Attention

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def is_sparse_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    """Whether layer `layer_idx` has routed experts (transformers' Qwen3MoeDecoderLayer rule)."""
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or []) and config.num_experts > 0
            and (layer_idx + 1) % config.decoder_sparse_step == 0)


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    def make_attention(self, config: PretrainedConfig, layer_idx: int) -> LlamaAttention:
        bias = getattr(config, "attention_bias", False)
        return Qwen3Attention(config, layer_idx, qkv_bias=bias, o_bias=bias)

    def make_mlp(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        return MixtralMoE(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                          config.moe_intermediate_size, renormalize=bool(config.norm_topk_prob),
                          hidden_act=config.hidden_act)


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    """Mixtral's expert loading with Qwen's expert weight names (`mlp.experts.<id>.gate_proj.weight`, ...)."""

    layer_type: ClassVar[type[LlamaDecoderLayer]] = Qwen3MoeDecoderLayer
    expert_names: ClassVar[tuple[str, str, str]] = ("gate_proj", "down_proj", "up_proj")

    @property
    def num_experts(self) -> int:
        return self.config.num_experts
