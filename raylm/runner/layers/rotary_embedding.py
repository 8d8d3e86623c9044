"""Rotary position embedding, neox style (transformers' rotate_half: the two halves of each head rotate
together), with a cos/sin cache indexed by position. On CPU in float32 or bfloat16 one kernel rotates q and k in
place."""
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


class RotaryEmbedding(nn.Module):
    cos_sin_cache: torch.Tensor  # [max_position, rotary_dim] buffer: cos | sin per position

    def __init__(self, head_size: int, rotary_dim: int, max_position: int, inv_freq: torch.Tensor) -> None:
        super().__init__()
        assert rotary_dim <= head_size and rotary_dim % 2 == 0
        self.head_size, self.rotary_dim, self.max_position = head_size, rotary_dim, max_position
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq.float())
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

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


def get_rope(head_size: int, max_position: int, base: float, rope_scaling: dict[str, Any] | None = None,
             rotary_dim: int | None = None) -> RotaryEmbedding:
    """One module (and cos/sin cache) per distinct setting and device, shared by every layer that asks."""
    rotary_dim = rotary_dim or head_size
    rope_scaling = rope_scaling or {}
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: 'default', 'llama3'")
    scaling_key = tuple(sorted((k, str(v)) for k, v in rope_scaling.items()))
    key = (head_size, rotary_dim, max_position, base, scaling_key, str(torch.get_default_device()))
    if key not in _ROPE_CACHE:
        inv_freq = (_llama3_inv_freq(base, rotary_dim, rope_scaling) if rope_type == "llama3"
                    else _default_inv_freq(base, rotary_dim))
        _ROPE_CACHE[key] = RotaryEmbedding(head_size, rotary_dim, max_position, inv_freq)
    return _ROPE_CACHE[key]
