"""DeepSeek-V2 and V3: multi-head latent attention (layers/mla_attention.py), dense MLPs in the first
`first_k_dense_replace` layers and MoE after them (routed experts with DeepSeek's routing, layers/expert_routing.py,
plus always-on shared experts), YaRN rotary with DeepSeek's mscale on the softmax scale, as transformers' models.

The rope part of q and k is rotated in interleaved pairs (x0, x1), (x2, x3), ... (V2 always, V3 where
`rope_interleave`), else neox halves; the cos/sin cache (and its YaRN scaling) is rotary_embedding.get_rope's.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from raylm.runner.layers.expert_routing import DeepseekRouting
from raylm.runner.layers.fused_moe import FusedMoE
from raylm.runner.layers.layernorm import RMSNorm
from raylm.runner.layers.linear import ColumnParallelLinear, RowParallelLinear
from raylm.runner.layers.mla_attention import MLAAttention
from raylm.runner.layers.rotary_embedding import get_rope, yarn_get_mscale
from raylm.runner.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, ShardId
from raylm.runner.models.mixtral import MixtralForCausalLM
from raylm.runner.models.utils import get_rope_config
from raylm.runner.parallel_state import get_tp_group

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from raylm.runner.layers.quantization.ggml_blocks import QuantizedTensor

# transformers' DeepSeek norms inside attention (q_a_layernorm, kv_a_layernorm) keep RMSNorm's default epsilon.
_LATENT_NORM_EPS = 1e-6


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [T, ..., R] rotated by cos/sin [T, R / 2] (broadcast over the middle dims)."""
    cos, sin = (t.view(t.shape[0], *([1] * (x.dim() - 2)), t.shape[-1]).to(x.dtype) for t in (cos, sin))
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class DeepseekV2MLAAttention(nn.Module):
    """MLA's projections around MLAAttention. q_proj (or q_a_proj -> q_a_layernorm -> q_b_proj with q_lora_rank),
    kv_b_proj and o_proj split by heads over TP; kv_a_proj_with_mqa (latent and rope key) is replicated."""

    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        tp_size = get_tp_group().world_size
        total_heads, hidden = config.num_attention_heads, config.hidden_size
        if total_heads % tp_size:
            raise ValueError(f"num_attention_heads: {total_heads} cannot be split over tensor_parallel_size "
                             f"{tp_size}; use a divisor of {total_heads}")
        self.num_heads = total_heads // tp_size
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        qk_head_dim, bias = self.nope + self.rope, bool(getattr(config, "attention_bias", False))
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, total_heads * qk_head_dim)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=_LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, total_heads * qk_head_dim)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=_LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, total_heads * (self.nope + self.v_head_dim))
        self.o_proj = RowParallelLinear(total_heads * self.v_head_dim, hidden, bias=bias)

        rope_theta, rope_scaling = get_rope_config(config)
        self.rotary_emb = get_rope(self.rope, config.max_position_embeddings, rope_theta, rope_scaling)
        self.interleaved = bool(getattr(config, "rope_interleave", True))  # V2 has no such field: interleaved
        scale = qk_head_dim**-0.5
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) == "yarn":
            # DeepSeek scales q.k by mscale twice (transformers' yarn_apply_mscale), beside YaRN's cos/sin factor.
            mscale_all_dim = rope_scaling.get("mscale_all_dim") or 0
            if mscale_all_dim:
                mscale = yarn_get_mscale(rope_scaling["factor"], mscale_all_dim)
                scale *= mscale * mscale
        self.attn = MLAAttention(self.num_heads, scale, self.nope, self.rope, self.v_head_dim, self.kv_lora_rank,
                                 layer_idx)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.unflatten(-1, (self.num_heads, self.nope + self.rope))
        kv_c, k_pe = self.kv_a_proj_with_mqa(hidden_states).split([self.kv_lora_rank, self.rope], dim=-1)
        kv_c_normed = self.kv_a_layernorm(kv_c.contiguous())
        cos, sin = self.rotary_emb.cos_sin_cache[positions].chunk(2, dim=-1)
        q = torch.cat([q[..., :self.nope], rotate(q[..., self.nope:], cos, sin, self.interleaved)], dim=-1)
        k_pe = rotate(k_pe, cos, sin, self.interleaved)
        return self.o_proj(self.attn(q, kv_c_normed, k_pe, self.kv_b_proj.weight))


class DeepseekV2MoE(nn.Module):
    """Router (float32 logits), routed experts and the shared experts (one MLP of n_shared_experts times the
    experts' width), added."""

    def __init__(self, config: PretrainedConfig, topk_method: str) -> None:
        super().__init__()
        num_experts, n_group = config.n_routed_experts, config.n_group or 1
        if topk_method != "greedy" and num_experts % n_group:
            raise ValueError(f"n_group: {n_group} groups cannot split n_routed_experts={num_experts} evenly "
                             f"({topk_method} routing picks whole groups); use a divisor of {num_experts}")
        self.gate = nn.Linear(config.hidden_size, num_experts, bias=False)
        bias = None
        if topk_method == "noaux_tc":  # float32 as transformers keeps it: it only orders near-equal scores
            bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)
            self.gate.register_parameter("e_score_correction_bias", bias)
        routing = DeepseekRouting(config.num_experts_per_tok, topk_method, n_group,
                                  config.topk_group or 1, bool(config.norm_topk_prob),
                                  float(config.routed_scaling_factor), bias)
        self.experts = FusedMoE(num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, renormalize=False, hidden_act=config.hidden_act,
                                routing=routing)
        shared = config.n_shared_experts or 0
        self.shared_experts = (LlamaMLP(config.hidden_size, config.moe_intermediate_size * shared, config.hidden_act)
                               if shared else None)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        router_logits = F.linear(hidden_states.float(), self.gate.weight.float())
        out = self.experts(hidden_states, router_logits)
        return out if self.shared_experts is None else out + self.shared_experts(hidden_states)


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    topk_method: ClassVar[str | None] = None  # None: the config's (V2); V3 always routes noaux_tc

    def make_attention(self, config: PretrainedConfig, layer_idx: int) -> LlamaAttention:
        return DeepseekV2MLAAttention(config, layer_idx)  # type: ignore[return-value]

    def make_mlp(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        if not config.n_routed_experts or layer_idx < (config.first_k_dense_replace or 0):
            return LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        return DeepseekV2MoE(config, self.topk_method or getattr(config, "topk_method", None) or "greedy")


class DeepseekV3DecoderLayer(DeepseekV2DecoderLayer):
    topk_method = "noaux_tc"


class DeepseekV2ForCausalLM(MixtralForCausalLM):
    """Expert weights by Mixtral's loading, with DeepSeek's names (`mlp.experts.<id>.gate_proj.weight`, ...)."""

    layer_type: ClassVar[type[LlamaDecoderLayer]] = DeepseekV2DecoderLayer
    expert_names: ClassVar[tuple[str, str, str]] = ("gate_proj", "down_proj", "up_proj")
    # No fused qkv: MLA's projections load by their own names.
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {"gate_up_proj": ["gate_proj", "up_proj"]}
    stacked_params_mapping: ClassVar[list[tuple[str, str, ShardId]]] = [
        (".gate_up_proj.", ".gate_proj.", 0),
        (".gate_up_proj.", ".up_proj.", 1),
    ]

    @property
    def num_experts(self) -> int:
        return self.config.n_routed_experts or 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> set[str]:
        # V3 checkpoints carry the multi-token-prediction layer after the last decoder layer: not run here.
        num_layers = self.config.num_hidden_layers
        return super().load_weights((name, tensor) for name, tensor in weights
                                    if not _is_layer_at_or_past(name, num_layers))


def _is_layer_at_or_past(name: str, num_layers: int) -> bool:
    parts = name.split(".")
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and int(parts[2]) >= num_layers


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    layer_type: ClassVar[type[LlamaDecoderLayer]] = DeepseekV3DecoderLayer
