"""Gemma 2: a Llama-shaped decoder with embeddings scaled by sqrt(hidden_size), RMSNorms that scale by
(1 + weight), norms after attention and around the feed-forward too, a GeGLU feed-forward (gelu, tanh
approximation), attention scaled by query_pre_attn_scalar, sliding-window layers alternating with global ones
(`layer_types`), and tanh soft-capping of the attention scores and of the final logits where the config sets them."""
from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from raylm.configs.attention_backends import attention_logits_soft_cap, layer_sliding_windows
from raylm.runner.layers.attention import Attention
from raylm.runner.layers.layernorm import RMSNorm
from raylm.runner.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from raylm.runner.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaled by (1 + weight) (the checkpoint stores the offset from one), in float32 then cast back, as
    transformers' Gemma norms; with a residual, the add is fused in as RMSNorm does it (not by its CPU kernel, which
    scales by the weight itself)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self.weight.data.zero_()

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class GemmaMLP(nn.Module):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x)), gate and up fused into one column-parallel linear."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_activation: str) -> None:
        super().__init__()
        if hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(f"unsupported hidden_activation {hidden_activation!r}; Gemma's is 'gelu_pytorch_tanh'")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma2Attention(LlamaAttention):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        bias = getattr(config, "attention_bias", False)
        super().__init__(config, layer_idx, qkv_bias=bias, o_bias=bias)
        # Llama's attention, scaled by query_pre_attn_scalar instead of head_dim, with the layer's window and cap.
        self.attn = Attention(self.num_heads, self.head_dim, config.query_pre_attn_scalar**-0.5, self.num_kv_heads,
                              layer_idx, sliding_window=layer_sliding_windows(config)[layer_idx],
                              logits_soft_cap=attention_logits_soft_cap(config))


class Gemma2DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def make_attention(self, config: PretrainedConfig, layer_idx: int) -> LlamaAttention:
        return Gemma2Attention(config, layer_idx)

    def make_mlp(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return GemmaMLP(config.hidden_size, config.intermediate_size, config.hidden_activation)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # transformers adds each sublayer's output after its post-norm; the residual threads as in Llama (vLLM's).
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.post_attention_layernorm(self.self_attn(positions, hidden_states))
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual


class Gemma2Model(LlamaModel):
    supports_layer_types = True

    def __init__(self, config: PretrainedConfig, layer_type: type[LlamaDecoderLayer], pp_rank: int = 0,
                 pp_size: int = 1, partition: list[int] | None = None) -> None:
        super().__init__(config, layer_type, pp_rank, pp_size, partition)
        if self.is_last_rank:
            self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # sqrt(hidden_size) rounded to the model's dtype first, as transformers multiplies it.
        self.normalizer: torch.Tensor
        self.register_buffer("normalizer", torch.tensor(config.hidden_size**0.5), persistent=False)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids)
        return embeds * self.normalizer.to(embeds.dtype)


class Gemma2ForCausalLM(LlamaForCausalLM):
    model_type: ClassVar[type[LlamaModel]] = Gemma2Model
    layer_type: ClassVar[type[LlamaDecoderLayer]] = Gemma2DecoderLayer

    def __init__(self, config: PretrainedConfig, pp_rank: int = 0, pp_size: int = 1,
                 partition: list[int] | None = None) -> None:
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError(f"{type(self).__name__}: use_bidirectional_attention is not supported (raylm runs "
                             f"causal language models)")
        super().__init__(config, pp_rank, pp_size, partition)
        cap = getattr(config, "final_logit_softcapping", None)
        self.final_logit_softcapping = float(cap) if cap else None

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
