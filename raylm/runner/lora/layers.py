"""The LoRA slots of one tensor-parallel linear (vLLM's *WithLoRA layers), hooked onto the layer as `layer.lora`.

A column-parallel layer (QKVParallelLinear, MergedColumnParallelLinear gate_up) keeps lora_a whole and its lora_b
rows sharded like the base weight's, slice by slice (q/k/v by heads, KV heads replicated past their count; gate/up by
halves). A row-parallel layer (o_proj, down_proj) takes its input already split: lora_a is sharded along the input
like the base weight, lora_b kept whole, and the partial products join the base's partial sums before the layer's
one all-reduce, since (sum_r x_r A_r^T) B^T is what the full input gives.
"""
from __future__ import annotations

import torch
from torch import nn

from raylm.runner.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from raylm.runner.lora.punica import PunicaWrapper, SlotWeights


class LoRASlots(nn.Module):
    """max_loras device slots of max_lora_rank for one linear layer, filled in place (the step never allocates)."""

    lora_a_t: torch.Tensor  # buffers (registered in __init__), read by punica.py's products
    lora_b: torch.Tensor

    def __init__(self, layer: LinearBase, punica: PunicaWrapper, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.punica, self.max_loras, self.max_rank = punica, max_loras, max_rank
        self.tp_rank, self.tp_size = layer.tp_rank, layer.tp_size
        self.row_parallel = isinstance(layer, RowParallelLinear)
        # The layer's shape, not its weight's: a quantized layer (GGUF) keeps packed blocks instead of a weight.
        in_local = layer.input_size_per_partition
        self.output_slices = _output_slices(layer)
        # Where each slice's full lora_b rows start and how they shard: (full offset of this rank's rows, local size).
        self._shards = _lora_b_shards(layer)
        num_slices, out_local = len(self.output_slices), layer.output_size_per_partition
        # Slot-major, as punica.py's products read them: each slot's lora_a transposed, the slices side by side; each
        # slot's lora_b transposed, slice i's rows in its own output columns (nothing stored twice, no zero blocks).
        self.register_buffer("lora_a_t", torch.zeros(max_loras, in_local, num_slices * max_rank, dtype=dtype,
                                                     device=device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, max_rank, out_local, dtype=dtype, device=device),
                             persistent=False)
        # Views of the buffers: sleep mode resizes their storage in place, so these stay valid.
        self.weights = SlotWeights(self.lora_a_t, self.lora_b, self.output_slices)
        assert sum(size for _, size in self.output_slices) == layer.output_size_per_partition

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """y (the layer's output on this rank, before any all-reduce) += the LoRA product of x, per token's slot."""
        if self.punica.has_lora:
            self.punica.add_lora_linear(y, x, self.weights)

    def set_lora(self, slot: int, weights: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Fill `slot` with one (lora_a [r, in], lora_b [out, r]) per output slice, full (unsharded) tensors, or None
        for a slice the adapter does not target; a rank below max_rank leaves the rest zero."""
        self.reset_lora(slot)
        rank = self.max_rank
        for i, pair in enumerate(weights):
            if pair is None:
                continue
            lora_a, lora_b = pair
            r = lora_a.shape[0]
            if self.row_parallel:
                size = self.lora_a_t.shape[1]
                lora_a = lora_a.narrow(1, self.tp_rank * size, size)
            else:
                start, size = self._shards[i]
                lora_b = lora_b.narrow(0, start, size)
            offset, width = self.output_slices[i]
            self.lora_a_t[slot, :, i * rank:i * rank + r].copy_(lora_a.t())
            self.lora_b[slot, :r, offset:offset + width].copy_(lora_b.t())

    def reset_lora(self, slot: int) -> None:
        self.lora_a_t[slot].zero_()
        self.lora_b[slot].zero_()


def _output_slices(layer: LinearBase) -> list[tuple[int, int]]:
    """(offset, size) of each packed output in the layer's local output: q/k/v, gate/up, or the whole."""
    if isinstance(layer, QKVParallelLinear):
        q, kv = layer.num_heads * layer.head_size, layer.num_kv_heads * layer.head_size
        return [(0, q), (q, kv), (q + kv, kv)]
    if isinstance(layer, MergedColumnParallelLinear):
        sizes = [size // layer.tp_size for size in layer.output_sizes]
        return [(sum(sizes[:i]), size) for i, size in enumerate(sizes)]
    return [(0, layer.output_size_per_partition)]


def _lora_b_shards(layer: LinearBase) -> list[tuple[int, int]]:
    """Per output slice: (first row of this rank's shard in the slice's full lora_b, rows), as the base weight."""
    if isinstance(layer, QKVParallelLinear):
        q, kv = layer.num_heads * layer.head_size, layer.num_kv_heads * layer.head_size
        kv_rank = layer.tp_rank // layer.num_kv_head_replicas
        return [(layer.tp_rank * q, q), (kv_rank * kv, kv), (kv_rank * kv, kv)]
    if isinstance(layer, MergedColumnParallelLinear):
        return [(layer.tp_rank * size // layer.tp_size, size // layer.tp_size) for size in layer.output_sizes]
    out_local = layer.output_size_per_partition
    return [(0 if isinstance(layer, RowParallelLinear) else layer.tp_rank * out_local, out_local)]
