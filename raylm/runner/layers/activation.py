"""Gated activations."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raylm.runner import cpu_kernels


class SiluAndMul(nn.Module):
    """[..., 2d] -> [..., d]: silu(gate) * up, with gate the first half."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = cpu_kernels.ops_for(x)
        if ops is not None and x.dim() == 2 and x.stride(-1) == 1:
            return ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
