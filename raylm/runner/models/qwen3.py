"""Qwen3: Llama with a per-head RMSNorm on q and k (over head_dim) before rotary; head_dim from the config."""
from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from raylm.runner.layers.layernorm import RMSNorm
from raylm.runner.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: PretrainedConfig, layer_idx: int, qkv_bias: bool = False, o_bias: bool = False) -> None:
        super().__init__(config, layer_idx, qkv_bias, o_bias)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.q_norm(q.unflatten(-1, (self.num_heads, self.head_dim))).flatten(-2)
        k = self.k_norm(k.unflatten(-1, (self.num_kv_heads, self.head_dim))).flatten(-2)
        return q, k


class Qwen3DecoderLayer(LlamaDecoderLayer):
    def make_attention(self, config: PretrainedConfig, layer_idx: int) -> LlamaAttention:
        bias = getattr(config, "attention_bias", False)
        return Qwen3Attention(config, layer_idx, qkv_bias=bias, o_bias=bias)


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_type: ClassVar[type[LlamaDecoderLayer]] = Qwen3DecoderLayer
