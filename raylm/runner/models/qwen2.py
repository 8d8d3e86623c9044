"""Qwen2: Llama with a bias on the q/k/v projections (none on o_proj)."""
from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from raylm.runner.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen2DecoderLayer(LlamaDecoderLayer):
    def make_attention(self, config: PretrainedConfig, layer_idx: int) -> LlamaAttention:
        return LlamaAttention(config, layer_idx, qkv_bias=True, o_bias=False)


class Qwen2ForCausalLM(LlamaForCausalLM):
    layer_type: ClassVar[type[LlamaDecoderLayer]] = Qwen2DecoderLayer
