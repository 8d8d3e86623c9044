"""Rotary position embedding, neox style (transformers' rotate_half: the two halves of each head's rotary dims rotate
together), with a cos/sin cache indexed by position. Every scaling here (linear, Llama 3, LongRoPE, YaRN) and partial
rotary (rotary_dim < head_size) is only another cache: on CPU in float32 or bfloat16 one kernel rotates q and k in
place from it, elsewhere the torch path does."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from raylm.runner import cpu_kernels


def _default_inv_freq(base: float, rotary_dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def _llama3_inv_freq(base: float, rotary_dim: int, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend in between."""
    inv_freq = _default_inv_freq(base, rotary_dim)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelen > old_context_len / low, inv_freq / factor,
                       torch.where(wavelen < old_context_len / high, inv_freq, blended))


def _original_max(scaling: dict[str, Any]) -> int:
    if "original_max_position_embeddings" not in scaling:
        raise ValueError(f"rope scaling {scaling.get('rope_type', scaling.get('type'))!r} needs "
                         "original_max_position_embeddings (the pre-training context) in rope_scaling")
    return int(scaling["original_max_position_embeddings"])


def _longrope(base: float, rotary_dim: int, max_position: int, scaling: dict[str, Any]
              ) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE ("su"): each frequency divided by its own factor, the short set or the long one, and cos/sin
    scaled by the attention factor. transformers picks the set per forward from the sequence length (the long one
    past original_max_position_embeddings) and, when a generation crosses that length, drops its KV cache and
    recomputes every key with the long set. A paged KV cache cannot re-rotate the keys it holds, so raylm picks one
    set for the model's whole context, as vLLM does (from max_model_len; here from the checkpoint's context): long
    where max_position exceeds the original context. That equals transformers on every sequence when the context is
    the original one, and on sequences past the original length otherwise."""
    original = _original_max(scaling)
    factor = scaling.get("factor") or max_position / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = scaling["long_factor"] if max_position > original else scaling["short_factor"]
    if len(ext) != rotary_dim // 2:
        raise ValueError(f"rope_scaling: {len(ext)} long/short factors for rotary_dim {rotary_dim}; "
                         f"LongRoPE needs rotary_dim / 2 = {rotary_dim // 2}")
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (torch.tensor(ext, dtype=torch.float32) * base**exponent), float(attention_factor)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(base: float, rotary_dim: int, max_position: int, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (transformers' _compute_yarn_parameters): high frequencies kept, low ones divided by `factor`, a linear
    ramp between the dims that turn beta_fast and beta_slow times over the original context; cos/sin scaled by the
    attention factor (DeepSeek's mscale / mscale_all_dim ratio where both are set)."""
    original = _original_max(scaling)
    factor = scaling.get("factor") or max_position / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else yarn_get_mscale(factor))
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    extrapolation = 1 - ramp  # the share of each dim left unscaled (written as transformers does, bit for bit)
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    cos_sin_cache: torch.Tensor  # [max_position, rotary_dim] float32 buffer: cos | sin per position

    def __init__(self, head_size: int, rotary_dim: int, max_position: int, inv_freq: torch.Tensor,
                 mscale: float = 1.0) -> None:
        """mscale multiplies cos and sin (LongRoPE's and YaRN's attention factor), as transformers does."""
        super().__init__()
        assert rotary_dim <= head_size and rotary_dim % 2 == 0
        self.head_size, self.rotary_dim, self.max_position = head_size, rotary_dim, max_position
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq.float())
        cache = torch.cat([freqs.cos() * mscale, freqs.sin() * mscale], dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x.unflatten(-1, (-1, self.head_size))
        rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)
        return out.flatten(-2)

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; query [T, num_heads*head_size], key [T, num_kv_heads*head_size] -> rotated (q, k)."""
        ops = cpu_kernels.ops_for(query)
        if (ops is not None and query.dim() == 2 and query.stride(-1) == 1 and key.stride(-1) == 1
                and positions.dtype == torch.int64):
            ops.rotary_embedding(positions.contiguous(), query, key, self.cos_sin_cache, self.head_size,
                                 self.rotary_dim)
            return query, key
        cos, sin = self.cos_sin_cache[positions].to(query.dtype).unsqueeze(-2).chunk(2, dim=-1)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, max_position={self.max_position}"


_ROPE_CACHE: dict[tuple[Any, ...], RotaryEmbedding] = {}
ROPE_TYPES = ("default", "linear", "llama3", "longrope", "su", "yarn")


def get_rope(head_size: int, max_position: int, base: float, rope_scaling: dict[str, Any] | None = None,
             rotary_dim: int | None = None) -> RotaryEmbedding:
    """One module (and cos/sin cache) per distinct setting and device, shared by every layer that asks. Without
    `rotary_dim`, the scaling's partial_rotary_factor (transformers 5 keeps it there) of the head rotates."""
    rope_scaling = rope_scaling or {}
    rotary_dim = rotary_dim or int(head_size * rope_scaling.get("partial_rotary_factor", 1.0))
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling: unsupported rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    scaling_key = tuple(sorted((k, str(v)) for k, v in rope_scaling.items()))
    key = (head_size, rotary_dim, max_position, base, scaling_key, str(torch.get_default_device()))
    if key not in _ROPE_CACHE:
        inv_freq, mscale, positions = _default_inv_freq(base, rotary_dim), 1.0, max_position
        if rope_type == "linear":  # positions divided by `factor` (Gemma 3's global layers)
            inv_freq = inv_freq / float(rope_scaling["factor"])
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(base, rotary_dim, rope_scaling)
        elif rope_type in ("longrope", "su"):
            inv_freq, mscale = _longrope(base, rotary_dim, max_position, rope_scaling)
        elif rope_type == "yarn":
            inv_freq, mscale = _yarn(base, rotary_dim, max_position, rope_scaling)
            # YaRN extends the original context by `factor` (vLLM sizes its cache so too)
            positions = max(max_position, int(_original_max(rope_scaling) * (rope_scaling.get("factor") or 1)))
        _ROPE_CACHE[key] = RotaryEmbedding(head_size, rotary_dim, positions, inv_freq, mscale)
    return _ROPE_CACHE[key]
