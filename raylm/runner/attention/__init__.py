"""Attention backends; the runner picks one by name."""
from __future__ import annotations

import os

import torch

from raylm.runner.attention.backend import AttentionBackend, AttentionMetadata
from raylm.runner.attention.common import CommonAttentionMetadata
from raylm.runner.attention.cpu_backend import CPUAttentionBackend
from raylm.runner.attention.flash_attn_backend import FlashAttentionBackend
from raylm.runner.attention.flash_attn_backend import unavailable_reason as _flash_attn_unavailable
from raylm.runner.attention.torch_backend import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "CommonAttentionMetadata", "CPUAttentionBackend",
           "FlashAttentionBackend", "TorchAttentionBackend", "choose_attn_backend", "get_attn_backend"]


def _triton_unavailable(device: torch.device) -> str | None:
    """Why the triton backend cannot run on `device`, or None when it can."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"the triton package does not import ({e}); install it with pip install 'raylm[triton]'"
    # Read as Triton reads it; the interpreter runs kernels on CPU tensors, slowly: for tests.
    interpreting = os.getenv("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")
    if device.type != "cuda" and not interpreting:
        return f"its kernels run on CUDA (device here: {device}), or on CPU only under TRITON_INTERPRET=1"
    return None


def _triton_backend() -> AttentionBackend:
    # Imported only here: triton is an optional extra, and its kernels are built (or interpreted) at import.
    from raylm.runner.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


def choose_attn_backend(name: str, device_type: str, dtype: torch.dtype = torch.float32, block_size: int = 16,
                        custom_ops: bool = True) -> str:
    """The backend `name` resolves to, checked: "auto" picks the fastest one available for the device, dtype and
    block_size (`custom_ops` False: raylm's CPU kernels are off); a named one must be able to run. Raises a
    ValueError naming the setting and why otherwise."""
    device = torch.device(device_type)
    cpu_fits = (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
                and block_size % CPUAttentionBackend.block_size_multiple == 0)
    if name == "auto":
        if _flash_attn_unavailable(device, dtype, block_size) is None:
            return FlashAttentionBackend.name
        if device.type == "cuda" and _triton_unavailable(device) is None:
            return "triton"
        return CPUAttentionBackend.name if cpu_fits and custom_ops and CPUAttentionBackend.is_available() else (
            TorchAttentionBackend.name)
    if name == TorchAttentionBackend.name:
        return name
    if name == CPUAttentionBackend.name:
        if not cpu_fits:
            raise ValueError(f"attention_backend 'cpu' runs float32 or bfloat16 on CPU with block_size a multiple of "
                             f"{CPUAttentionBackend.block_size_multiple} (here: device {device}, "
                             f"dtype {dtype}, block_size {block_size}); use 'torch' or 'auto'")
        if not custom_ops:
            raise ValueError("attention_backend 'cpu' needs raylm's CPU kernels, which custom_ops='none' turns off")
        if not CPUAttentionBackend.is_available():
            raise ValueError("attention_backend 'cpu': its kernels could not be built here (see the warning "
                             "above); use 'torch' or 'auto'")
        return name
    if name == "triton":
        reason = _triton_unavailable(device)
        if reason is not None:
            raise ValueError(f"attention_backend 'triton' is not available: {reason}; use 'torch' or 'auto'")
        return name
    if name == FlashAttentionBackend.name:
        reason = _flash_attn_unavailable(device, dtype, block_size)
        if reason is not None:
            raise ValueError(f"attention_backend 'flash_attn' is not available: {reason}; use 'triton', 'torch' or "
                             f"'auto'")
        return name
    raise ValueError(f"unknown attention backend {name!r}; known: 'auto', 'torch', 'cpu', 'triton', 'flash_attn'")


def get_attn_backend(name: str) -> AttentionBackend:
    """The backend of a resolved name (choose_attn_backend decided and checked it)."""
    if name == TorchAttentionBackend.name:
        return TorchAttentionBackend()
    if name == CPUAttentionBackend.name:
        return CPUAttentionBackend()
    if name == FlashAttentionBackend.name:
        return FlashAttentionBackend()
    assert name == "triton", f"attention backend {name!r} was not resolved"
    return _triton_backend()
