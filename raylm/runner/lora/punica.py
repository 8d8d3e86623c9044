"""The LoRA product of a whole batch in one pass per layer (the shrink / expand of vLLM's punica kernels), in torch.

Every token carries the device slot of its adapter (or none). A layer's slots are stacked so that one matmul shrinks
the batch against every slot's lora_a at once; a per-token one-hot mask then keeps each token's own slot, and one
addmm per output slice expands it through the stacked lora_b, straight into the base layer's output. Shapes depend
only on max_loras and max_lora_rank, never on which adapters a batch holds: nothing is allocated for an adapter, and
a token without an adapter adds exact zeros. The price: every token pays for rank max_loras * max_lora_rank, whichever
adapter it uses (two to four GEMMs per layer, a fixed number of ops; docs/lora.md measures what that costs).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


class PunicaWrapper:
    """The step's per-token adapter slots, as the mask every LoRA layer of the model reads (vLLM's PunicaWrapper)."""

    def __init__(self, max_num_tokens: int, max_loras: int, dtype: torch.dtype, device: torch.device) -> None:
        self.max_loras = max_loras
        pin = device.type == "cuda"
        self.token_lora_indices = torch.full((max_num_tokens,), -1, dtype=torch.int64, pin_memory=pin)
        self._indices_np = self.token_lora_indices.numpy()
        self._indices = self.token_lora_indices if device.type == "cpu" else torch.full(
            (max_num_tokens,), -1, dtype=torch.int64, device=device)
        self._slots = torch.arange(max_loras, device=device)
        self._hit = torch.zeros((max_num_tokens, max_loras), dtype=torch.bool, device=device)
        self.mask = torch.zeros((max_num_tokens, max_loras), dtype=dtype, device=device)
        self.has_lora = False  # whether any token of the current forward has an adapter

    def update(self, token_slots: np.ndarray) -> None:
        """Token i of the forward uses slot token_slots[i] (-1: none). Padding rows after them keep whatever mask
        they had: their outputs are never sampled nor written to the KV cache."""
        n = len(token_slots)
        self.has_lora = bool((token_slots >= 0).any())
        if not self.has_lora:
            return
        self._indices_np[:n] = token_slots
        if self._indices is not self.token_lora_indices:
            self._indices[:n].copy_(self.token_lora_indices[:n], non_blocking=True)
        hit = self._hit[:n]
        torch.eq(self._indices[:n, None], self._slots[None, :], out=hit)
        self.mask[:n].copy_(hit)

    def clear(self) -> None:
        self.has_lora = False

    def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: list[torch.Tensor],
                        output_slices: list[tuple[int, int]], rank: int) -> None:
        """y[:, slice i] += per token, x @ lora_a[slot, i].T @ lora_b[slot, i].T, for the token's slot.

        lora_a: [n_slices * max_loras * rank, in], rows ordered (slice, slot, rank); lora_b[i]: [max_loras * rank,
        size_i], rows ordered (slot, rank)."""
        num_tokens, num_slices, max_loras = x.shape[0], len(output_slices), self.max_loras
        shrunk = F.linear(x, lora_a).view(num_tokens, num_slices, max_loras, rank)
        shrunk.mul_(self.mask[:num_tokens, None, :, None])
        for i, (offset, size) in enumerate(output_slices):
            y[:, offset:offset + size].addmm_(shrunk[:, i].reshape(num_tokens, max_loras * rank), lora_b[i])
