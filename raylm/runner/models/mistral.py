"""Mistral: Llama whose every layer attends over a sliding window of `sliding_window` positions (none when the config
sets it to null, as Mistral 7B v0.2 onwards do)."""
from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from raylm.configs.attention_backends import layer_sliding_windows
from raylm.runner.layers.attention import Attention
from raylm.runner.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class MistralDecoderLayer(LlamaDecoderLayer):
    def make_attention(self, config: PretrainedConfig, layer_idx: int) -> LlamaAttention:
        attention = super().make_attention(config, layer_idx)
        window = layer_sliding_windows(config)[layer_idx]
        if window is not None:  # Llama's attention with the window: the one thing Mistral changes
            attention.attn = Attention(attention.num_heads, attention.head_dim, attention.head_dim**-0.5,
                                       attention.num_kv_heads, layer_idx, sliding_window=window)
        return attention


class MistralForCausalLM(LlamaForCausalLM):
    layer_type: ClassVar[type[LlamaDecoderLayer]] = MistralDecoderLayer
