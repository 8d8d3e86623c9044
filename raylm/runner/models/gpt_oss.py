"""GPT-OSS: Llama-shaped layers with biased q/k/v/o projections, attention sinks (a learned logit per head that joins
each softmax's denominator), sliding-window layers alternating with full ones (`layer_types`), YaRN rotary, and a
mixture of experts in every layer (runner/layers/gpt_oss_experts.py: biased router, top-k then softmax, biased experts
with a clamped SwiGLU)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from raylm.configs.attention_backends import layer_sliding_windows
from raylm.runner.layers.attention import Attention
from raylm.runner.layers.gpt_oss_experts import GptOssExperts
from raylm.runner.layers.linear import set_weight_loader
from raylm.runner.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from raylm.runner.layers.quantization.ggml_blocks import QuantizedTensor


class GptOssAttention(LlamaAttention):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        bias = getattr(config, "attention_bias", True)
        super().__init__(config, layer_idx, qkv_bias=bias, o_bias=bias)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_idx,
                              sliding_window=layer_sliding_windows(config)[layer_idx])
        # This TP rank's heads' sinks, in float32 whatever the model's dtype (as the kernels read them).
        self.sinks = set_weight_loader(nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32),
                                                    requires_grad=False), self._load_sinks)

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        total = self.qkv_proj.total_num_heads
        if tuple(loaded.shape) != (total,):
            raise ValueError(f"self_attn.sinks: checkpoint tensor of shape {tuple(loaded.shape)}, expected ({total},) "
                             f"from num_attention_heads")
        param.data.copy_(loaded.narrow(0, self.qkv_proj.tp_rank * self.num_heads, self.num_heads))

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, sinks=self.sinks))


class GptOssMoE(nn.Module):
    """The router (replicated, with a bias) and the experts; named as the checkpoint names them."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.router = nn.Linear(config.hidden_size, config.num_local_experts, bias=True)
        self.experts = GptOssExperts(config.num_local_experts, config.num_experts_per_tok, config.hidden_size,
                                     config.intermediate_size, config.swiglu_alpha, config.swiglu_limit)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.router(hidden_states))


class GptOssDecoderLayer(LlamaDecoderLayer):
    def make_attention(self, config: PretrainedConfig, layer_idx: int) -> LlamaAttention:
        return GptOssAttention(config, layer_idx)

    def make_mlp(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return GptOssMoE(config)


class GptOssModel(LlamaModel):
    supports_layer_types = True


class GptOssForCausalLM(LlamaForCausalLM):
    model_type: ClassVar[type[LlamaModel]] = GptOssModel
    layer_type: ClassVar[type[LlamaDecoderLayer]] = GptOssDecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> set[str]:
        def checked() -> Iterable[tuple[str, torch.Tensor | QuantizedTensor]]:
            for name, tensor in weights:
                if name.endswith(("_blocks", "_scales")):  # openai/gpt-oss-*'s own upload packs its experts
                    raise ValueError(f"checkpoint weight {name!r}: MXFP4-packed experts are not supported; use a "
                                     f"checkpoint with bfloat16 experts (e.g. a dequantized GPT-OSS)")
                yield name, tensor
        return super().load_weights(checked())
