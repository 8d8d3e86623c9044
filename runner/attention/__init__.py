"""Attention backends; the runner picks one by name."""
from __future__ import annotations

import torch

from runner.attention.backend import AttentionBackend, AttentionMetadata
from runner.attention.common import CommonAttentionMetadata
from runner.attention.cpu_backend import CPUAttentionBackend
from runner.attention.torch_backend import TorchAttentionBackend

_NOT_YET = ("triton", "flash_attn")

__all__ = ["AttentionBackend", "AttentionMetadata", "CommonAttentionMetadata", "CPUAttentionBackend",
           "TorchAttentionBackend", "get_attn_backend"]


def get_attn_backend(name: str = "auto", device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                     block_size: int = 16) -> AttentionBackend:
    """The backend called `name`; "auto" picks the fastest one available for `device`, `dtype` and `block_size`."""
    on_cpu = torch.device(device).type == "cpu"
    cpu_fits = on_cpu and dtype == torch.float32 and block_size % CPUAttentionBackend.block_size_multiple == 0
    if name == "auto":
        return CPUAttentionBackend() if cpu_fits and CPUAttentionBackend.is_available() else TorchAttentionBackend()
    if name == TorchAttentionBackend.name:
        return TorchAttentionBackend()
    if name == CPUAttentionBackend.name:
        if not cpu_fits:
            raise ValueError(f"attention_backend 'cpu' runs float32 on CPU with block_size a multiple of "
                             f"{CPUAttentionBackend.block_size_multiple} (here: device {torch.device(device)}, "
                             f"dtype {dtype}, block_size {block_size}); use 'torch' or 'auto'")
        if not CPUAttentionBackend.is_available():
            raise ValueError("attention_backend 'cpu': its kernels could not be built here (see the warning "
                             "above); use 'torch' or 'auto'")
        return CPUAttentionBackend()
    if name in _NOT_YET:
        raise ValueError(f"attention backend {name!r} is not available yet (device {torch.device(device)}); "
                         f"use 'torch', 'cpu' or 'auto'")
    raise ValueError(f"unknown attention backend {name!r}; known: 'auto', 'torch', 'cpu', "
                     f"{', '.join(map(repr, _NOT_YET))}")
