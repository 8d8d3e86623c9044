"""Attention backends; the runner picks one by name."""
from __future__ import annotations

import torch

from runner.attention.backend import AttentionBackend, AttentionMetadata
from runner.attention.common import CommonAttentionMetadata
from runner.attention.torch_backend import TorchAttentionBackend

_NOT_YET = ("triton", "flash_attn")

__all__ = ["AttentionBackend", "AttentionMetadata", "CommonAttentionMetadata", "TorchAttentionBackend",
           "get_attn_backend"]


def get_attn_backend(name: str = "auto", device: torch.device | str = "cpu") -> AttentionBackend:
    """The backend called `name`; "auto" picks the fastest one available on `device`."""
    if name in ("auto", TorchAttentionBackend.name):
        return TorchAttentionBackend()
    if name in _NOT_YET:
        raise ValueError(f"attention backend {name!r} is not available yet (device {torch.device(device)}); "
                         f"use 'torch' or 'auto'")
    raise ValueError(f"unknown attention backend {name!r}; known: 'auto', 'torch', {', '.join(map(repr, _NOT_YET))}")
