"""RMSNorm with the residual add fused in, as the decoder layers thread it. On CPU in float32 or bfloat16 one fused
kernel does the add and the norm, in place as vLLM's `fused_add_rms_norm`."""
from __future__ import annotations

import torch
from torch import nn

from raylm.runner import cpu_kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in float32, the scale in the input dtype: the order transformers uses.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x32.to(x.dtype)

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with a residual: (norm(x + residual), x + residual); the fused kernel reuses the storage
        of x and residual for the two results."""
        ops = cpu_kernels.ops_for(x)
        if ops is not None and x.stride(-1) == 1:
            if residual is None:
                return ops.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.variance_epsilon).view(x.shape)
            if x.dim() == 2 and x.is_contiguous() and residual.is_contiguous():
                ops.fused_add_rms_norm(x, residual, self.weight, self.variance_epsilon)
                return x, residual
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"
