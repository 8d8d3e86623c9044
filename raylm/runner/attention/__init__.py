"""Attention backends; the runner picks one by name."""
from __future__ import annotations

import importlib
import os

import torch

from raylm.configs.attention_backends import choose_attention_backend, missing_kernel_message
from raylm.configs.environment import EnvironmentFacts
from raylm.runner.attention.backend import AttentionBackend, AttentionMetadata
from raylm.runner.attention.common import CommonAttentionMetadata
from raylm.runner.attention.cpu_backend import CPUAttentionBackend
from raylm.runner.attention.flash_attn_backend import FlashAttentionBackend
from raylm.runner.attention.torch_backend import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "CommonAttentionMetadata", "CPUAttentionBackend",
           "FlashAttentionBackend", "TorchAttentionBackend", "choose_attn_backend", "get_attn_backend",
           "missing_kernels", "triton_interpret"]


def missing_kernels(devices: set[str]) -> dict[str, str]:
    """The attention kernels for `devices` that cannot run in this process -> why (an EnvironmentFacts input: the
    choice itself is configs/attention_backends.py's). Only those of the given devices are tried: importing triton
    and building raylm's CPU kernels take seconds."""
    missing = {}
    packages = ["flash_attn", "triton"] if "cuda" in devices else ["triton"] if triton_interpret() else []
    for name in packages:
        try:
            importlib.import_module(name)
        except ImportError as e:
            missing[name] = missing_kernel_message(name, str(e))
    if "cpu" in devices and not CPUAttentionBackend.is_available():
        missing["cpu"] = "its kernels could not be built here (see the warning above)"
    return missing


def triton_interpret() -> bool:
    """Read as Triton reads it; the interpreter runs kernels on CPU tensors, slowly: for tests."""
    return os.getenv("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def _triton_backend() -> AttentionBackend:
    # Imported only here: triton is an optional extra, and its kernels are built (or interpreted) at import.
    from raylm.runner.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


def choose_attn_backend(name: str, device_type: str, dtype: torch.dtype = torch.float32, block_size: int = 16,
                        custom_ops: bool = True) -> str:
    """configs/attention_backends.py's choice for this process's kernels (tests and scripts outside an engine)."""
    device = torch.device(device_type).type
    env = EnvironmentFacts(missing_kernels=missing_kernels({device}), triton_interpret=triton_interpret())
    return choose_attention_backend(name, device, str(dtype).removeprefix("torch."), block_size, custom_ops, env)


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
