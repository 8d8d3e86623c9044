"""The LoRA product of a whole batch, each token against its own adapter's rows only (vLLM's punica SGMV), in torch.

Every token carries the device slot of its adapter (or none). Once per step, on the host, the tokens are grouped by
slot (PunicaWrapper.update); then every LoRA layer of the model
  gathers the batch's LoRA tokens into slot order (one index_select),
  shrinks each slot's tokens by that slot's lora_a and expands them by that slot's lora_b (block diagonal over the
    layer's output slices, so that one product covers q/k/v or gate/up),
  scatters back: y += the expanded rows in token order (one index_select and one add; a base-model token reads a row
    of exact zeros, so its output is the one an engine without LoRA gives).
A token costs its adapter's rows, not max_loras x max_lora_rank: an earlier version shrank every token by every slot
and masked, which cost about as much as the base linears with 8 adapters of rank 16 on the 5m model (docs/lora.md).

The grouped tokens take one of two layouts, chosen per step:
- padded: each slot of the active range gets `cap` rows (the most tokens a slot has), so that the shrink and the
  expand are one bmm each over [slots, cap, ...]. A fixed handful of ops per layer: what decode needs, where the
  tokens are many 1-token requests spread over the slots and per-op overhead, not FLOPs, is the cost on a CPU.
- segments: the slots' tokens back to back, one mm pair per active slot. For a step whose slots are uneven (a long
  prefill beside a few decodes), where padding every slot to the longest would waste more than the extra ops cost.
When the LoRA tokens come first and are already in slot order without padding (one adapter for the whole step, say),
the gather and the scatter are skipped.

Nothing here is sized by an adapter: the index buffers are preallocated for max_num_tokens and the slots are fixed.
The products' temporaries follow the step's token counts, as any layer's activations do.
"""
from __future__ import annotations

import numpy as np
import torch

# Padding rows allowed per active slot before the segments layout is used instead. A padding row costs one token's
# LoRA product (a few µs for the four linears of a 5m-model layer); the segments layout costs two more ops per slot
# per linear (~10 µs each on a CPU). Eight rows per slot is about where they cross on the 5m model; a decode batch
# spread round robin pads by less than one row per slot, a long prefill beside decodes by far more.
PAD_ROWS_PER_SLOT = 8


class PunicaWrapper:
    """The step's tokens grouped by adapter slot, as every LoRA layer of the model reads them (vLLM's
    PunicaWrapper)."""

    def __init__(self, max_num_tokens: int, max_loras: int, device: torch.device) -> None:
        self.max_loras = max_loras
        pin = device.type == "cuda"
        # gather[position] = the token whose x fills that row of the grouped layout (padding rows: token 0).
        # scatter[token] = the grouped row its LoRA output is in (base-model tokens: the zero row after them).
        max_rows = max_num_tokens + PAD_ROWS_PER_SLOT * max_loras
        self._host = {name: torch.zeros(size, dtype=torch.int64, pin_memory=pin)
                      for name, size in (("gather", max_rows), ("scatter", max_num_tokens))}
        self._host_np = {name: tensor.numpy() for name, tensor in self._host.items()}
        self._device = self._host if device.type == "cpu" else {
            name: torch.zeros_like(tensor, device=device) for name, tensor in self._host.items()}
        self.has_lora = False  # whether any token of the current forward has an adapter
        self.num_tokens = 0  # tokens of the step (the forward's x may have padding rows after them)
        self.rows = 0  # rows of the grouped layout: LoRA tokens, plus padding in the padded layout
        self.first_slot, self.num_groups, self.cap = 0, 0, 0  # padded layout: slots [first, first + groups) x cap
        self.segments: list[tuple[int, int, int]] = []  # segments layout: (slot, start row, end row)
        self.in_order = False  # the grouped layout is tokens [0, rows) as they are: no gather, no scatter

    def update(self, token_slots: np.ndarray) -> None:
        """Token i of the forward uses slot token_slots[i] (-1: none): group the tokens by slot for this step."""
        n = self.num_tokens = len(token_slots)
        lora = token_slots >= 0
        counts = np.bincount(token_slots[lora], minlength=self.max_loras)
        num_lora = int(counts.sum())
        self.has_lora = num_lora > 0
        if not self.has_lora:
            return
        # Tokens in slot order, each slot's in batch order; base-model tokens last (not grouped).
        by_slot = np.argsort(np.where(lora, token_slots, self.max_loras), kind="stable")[:num_lora]
        slot_of = token_slots[by_slot]
        starts = np.cumsum(counts) - counts  # each slot's first row when the slots are back to back
        active = np.flatnonzero(counts)
        first, end, cap = int(active[0]), int(active[-1]) + 1, int(counts.max())
        if (end - first) * cap - num_lora <= PAD_ROWS_PER_SLOT * len(active):
            self.first_slot, self.num_groups, self.cap, self.segments = first, end - first, cap, []
            self.rows = self.num_groups * cap
            positions = (slot_of - first) * cap + (np.arange(num_lora) - starts[slot_of])
        else:
            self.segments = [(int(k), int(starts[k]), int(starts[k] + counts[k])) for k in active]
            self.rows = num_lora
            positions = np.arange(num_lora)
        self.in_order = self.rows == num_lora and bool((by_slot == positions).all())
        if self.in_order:
            return
        gather, scatter = self._host_np["gather"], self._host_np["scatter"]
        gather[:self.rows] = 0
        gather[positions] = by_slot
        scatter[:n] = self.rows
        scatter[by_slot] = positions
        if self._device is not self._host:
            for name, size in (("gather", self.rows), ("scatter", n)):
                self._device[name][:size].copy_(self._host[name][:size], non_blocking=True)

    def clear(self) -> None:
        self.has_lora = False

    def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        """y[t] += x[t] @ lora_a[slot].T @ lora_b[slot] for each token t of the step with an adapter slot.

        lora_a: [max_loras, n_slices * rank, in]; lora_b: [max_loras, n_slices * rank, out], block diagonal (slice
        i's rank rows feed only slice i's output columns)."""
        rows, n, out = self.rows, self.num_tokens, y.shape[1]
        grouped = x[:rows] if self.in_order else x.index_select(0, self._device["gather"][:rows])
        expanded = x.new_empty(rows + 1, out)  # the extra row: zeros for base-model tokens to read
        if self.segments:
            shrunk = x.new_empty(rows, lora_a.shape[1])
            for slot, start, end in self.segments:
                torch.mm(grouped[start:end], lora_a[slot].t(), out=shrunk[start:end])
                torch.mm(shrunk[start:end], lora_b[slot], out=expanded[start:end])
        else:
            slots = slice(self.first_slot, self.first_slot + self.num_groups)
            shrunk = torch.bmm(grouped.reshape(self.num_groups, self.cap, -1), lora_a[slots].transpose(1, 2))
            torch.bmm(shrunk, lora_b[slots], out=expanded[:rows].view(self.num_groups, self.cap, out))
        if self.in_order:
            y[:rows].add_(expanded[:rows])
            return
        expanded[rows].zero_()
        y[:n].add_(expanded.index_select(0, self._device["scatter"][:n]))
