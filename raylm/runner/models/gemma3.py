"""Gemma 3 (text): Gemma 2 with a (1 + weight) RMSNorm on each head's q and k before rotary, rotary bases per layer
kind (sliding layers: rope_local_base_freq, 10k; global ones: rope_theta, 1M, with its scaling), the layer pattern of
`layer_types` (five sliding layers to one global by default) and no attention soft-capping (its config may keep
attn_logit_softcapping; transformers and vLLM ignore it). The final logits are soft-capped where the config says."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from raylm.runner.layers.rotary_embedding import get_rope
from raylm.runner.models.gemma2 import Gemma2Attention, Gemma2DecoderLayer, Gemma2ForCausalLM, GemmaRMSNorm
from raylm.runner.models.llama import LlamaAttention, LlamaDecoderLayer

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def layer_rope(config: PretrainedConfig, layer_idx: int) -> tuple[float, dict[str, Any] | None]:
    """(base, scaling dict or None) of layer `layer_idx`'s rotary embedding. transformers 5 keeps them per layer kind
    in rope_parameters; older configs as rope_local_base_freq (sliding) and rope_theta / rope_scaling (global)."""
    kind = config.layer_types[layer_idx]
    params = getattr(config, "rope_parameters", None) or {}
    if kind in params:
        rope = dict(params[kind])
    elif kind == "sliding_attention":
        rope = {"rope_theta": config.rope_local_base_freq}
    else:
        rope = {"rope_theta": config.rope_theta, **(getattr(config, "rope_scaling", None) or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    return float(rope["rope_theta"]), (rope if rope_type != "default" else None)


class Gemma3Attention(Gemma2Attention):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.q_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.rotary_emb = get_rope(self.head_dim, config.max_position_embeddings, *layer_rope(config, layer_idx))

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.q_norm(q.unflatten(-1, (self.num_heads, self.head_dim))).flatten(-2)
        k = self.k_norm(k.unflatten(-1, (self.num_kv_heads, self.head_dim))).flatten(-2)
        return q, k


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    def make_attention(self, config: PretrainedConfig, layer_idx: int) -> LlamaAttention:
        return Gemma3Attention(config, layer_idx)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    layer_type: ClassVar[type[LlamaDecoderLayer]] = Gemma3DecoderLayer
