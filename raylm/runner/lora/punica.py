"""The LoRA product of a whole batch, each token against its own adapter's rows only (vLLM's punica SGMV), in torch.

Every token carries the device slot of its adapter (or none). Once per step, on the host, PunicaWrapper.update plans
how the tokens meet their slots' weights; every LoRA layer of the model then follows that plan. A token costs its own
adapter's rank, not max_loras x max_lora_rank: an earlier version shrank every token by every slot and masked, which
on the 5m model with 8 adapters of rank 16 cost about as much as the base linears (docs/lora.md).

- Runs: a request's tokens are contiguous and share a slot, so a prefill is a run of tokens of one slot. A run of at
  least RUN_MIN_TOKENS is computed in place: one shrink of x's rows by the slot's lora_a, then per output slice one
  addmm straight into y's rows and columns. No copy of x or y.
- Grouped: the other LoRA tokens (decodes, short prompts: often 1-token requests spread over the slots) are gathered
  into slot order (one index_select), shrunk and expanded slot by slot in batched products, then added to their rows
  of y (one index_add). Two layouts of the grouped rows:
  - padded: each slot of the active range gets `cap` rows (the most tokens a slot has), so that the shrink and each
    slice's expand are one bmm over [slots, cap, ...]; the padding rows compute values nobody reads. A fixed handful
    of ops per layer: at decode sizes on a CPU, per-op overhead (a few µs, a view included) costs more than FLOPs.
  - segments: the slots' tokens back to back, one mm per slot and product. For uneven slots (many decodes of a popular
    adapter beside a few of others), where padding every slot to the longest would cost more than the extra ops.
  When the grouped tokens are the step's first tokens and already in slot order, the gather and index_add are skipped.

With raylm's CPU kernels (float32 on a CPU) none of that: the step's LoRA tokens sorted by slot go to one fused
kernel call per linear (runner/csrc/lora_ops.h), which reads each slot's weights once per few tokens and adds straight
into y's rows.

Base-model tokens are in neither, so their rows of y are left exactly as the base layer wrote them. Nothing here is
sized by an adapter: the index buffers are preallocated for max_num_tokens and the slots are fixed; the products'
temporaries follow the step's token counts, as any layer's activations do.
"""
from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

# A run this long is computed in place: 1 + n_slices products of its own (a few µs of overhead each on a CPU) against
# copying its rows of x in and of the expand out (the grouped path), which costs more once a run is this long.
RUN_MIN_TOKENS = 32
# Padding rows allowed per active slot before the grouped tokens take the segments layout instead. A padding row costs
# one token's LoRA product (a few µs for a 5m-model layer's four linears); segments cost a few more ops per slot per
# linear. Eight rows per slot is about where they cross on the 5m model; decodes spread round robin pad by less than
# one row per slot.
PAD_ROWS_PER_SLOT = 8


class SlotWeights:
    """One layer's slots as the product reads them, with the views it needs made once (on a CPU a view costs about
    what a small product does).

    lora_a_t: [max_loras, in, n_slices * rank], each slot's lora_a transposed, slices side by side (one shrink covers
    q/k/v or gate/up). lora_b: [max_loras, rank, out]: slice i's lora_b transposed in output_slices[i]'s columns."""

    def __init__(self, lora_a_t: torch.Tensor, lora_b: torch.Tensor, output_slices: list[tuple[int, int]]) -> None:
        self.lora_a_t, self.lora_b, self.max_loras = lora_a_t, lora_b, lora_a_t.shape[0]
        rank = lora_b.shape[1]
        # Per output slice: its shrunk columns and its lora_b columns (all slots, then per slot).
        self.shrunk_cols = [slice(i * rank, (i + 1) * rank) for i in range(len(output_slices))]
        self.out_cols = [slice(offset, offset + size) for offset, size in output_slices]
        self.b_slices = [lora_b[:, :, cols] for cols in self.out_cols]
        self.slice_bounds = [offset for offset, _ in output_slices] + [sum(size for _, size in output_slices)]
        self.a_t_of = list(lora_a_t)
        self.b_slices_of = [[b[slot] for b in self.b_slices] for slot in range(self.max_loras)]

    def slot_range(self, first: int, num: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """lora_a_t and lora_b's slices for slots [first, first + num)."""
        if num == self.max_loras:
            return self.lora_a_t, self.b_slices
        return self.lora_a_t[first:first + num], [b[first:first + num] for b in self.b_slices]


class PunicaWrapper:
    """The step's plan: which tokens use which adapter slot, as every LoRA layer reads it (vLLM's PunicaWrapper)."""

    def __init__(self, max_num_tokens: int, max_loras: int, device: torch.device,
                 kernels: ModuleType | None = None) -> None:
        """kernels: raylm's CPU kernels where they apply to the LoRA weights (cpu_kernels.ops_for_kind), else the
        torch products."""
        self.max_loras, self.kernels = max_loras, kernels
        pin = device.type == "cuda"
        # gather[row]: the token whose x fills that row of the grouped layout (padding rows: token 0).
        # tokens[i], positions[i]: the i-th grouped token and its row in the layout (kernels: tokens[i], slots[i]:
        # the i-th LoRA token by slot, and its slot).
        sizes = {"gather": max_num_tokens + PAD_ROWS_PER_SLOT * max_loras, "tokens": max_num_tokens,
                 "positions": max_num_tokens, "slots": max_num_tokens}
        self._host = {name: torch.zeros(size, dtype=torch.int64, pin_memory=pin) for name, size in sizes.items()}
        self._host_np = {name: tensor.numpy() for name, tensor in self._host.items()}
        self._device = self._host if device.type == "cpu" else {
            name: torch.zeros_like(tensor, device=device) for name, tensor in self._host.items()}
        self._step: dict[str, torch.Tensor] = {}  # this step's part of each index buffer
        self.has_lora = False  # whether any token of the current forward has an adapter
        self.runs: list[tuple[int, int, int]] = []  # (slot, first token, end token) of each run computed in place
        self.num_grouped = 0  # grouped tokens
        self.rows = 0  # rows of the grouped layout: the grouped tokens, plus padding in the padded layout
        self.first_slot, self.num_groups, self.cap = 0, 0, 0  # padded layout: slots [first, first + groups) x cap
        self.segments: list[tuple[int, int, int]] = []  # segments layout: (slot, first row, end row)
        self.in_order = False  # grouped row i is token i: no gather, no index_add

    def update(self, token_slots: np.ndarray) -> None:
        """Token i of the forward uses slot token_slots[i] (-1: none): plan the step's runs and grouped tokens."""
        lora = token_slots >= 0
        self.has_lora = bool(lora.any())
        if not self.has_lora:
            return
        if self.kernels is not None:
            self._sort_for_kernel(token_slots, lora)
            return
        # Maximal runs of one slot; the long ones with an adapter are computed in place.
        starts = np.flatnonzero(np.diff(token_slots, prepend=-2))
        ends = np.append(starts[1:], len(token_slots))
        in_place = (token_slots[starts] >= 0) & (ends - starts >= RUN_MIN_TOKENS)
        self.runs = [(int(token_slots[s]), int(s), int(e)) for s, e in zip(starts[in_place], ends[in_place])]
        grouped = lora & ~np.repeat(in_place, ends - starts)
        self.num_grouped = int(grouped.sum())
        if self.num_grouped:
            self._group(np.where(grouped, token_slots, -1))

    def _group(self, token_slots: np.ndarray) -> None:
        """Lay out the tokens with a slot (token_slots >= 0) by slot: padded or segments (module docstring)."""
        num = self.num_grouped
        counts = np.bincount(token_slots[token_slots >= 0], minlength=self.max_loras)
        # The grouped tokens in slot order, each slot's in batch order (a stable sort; tokens without a slot last).
        tokens = np.argsort(np.where(token_slots >= 0, token_slots, self.max_loras), kind="stable")[:num]
        slot_of = token_slots[tokens]
        firsts = np.cumsum(counts) - counts  # each slot's first row when the slots are back to back
        active = np.flatnonzero(counts)
        first, end, cap = int(active[0]), int(active[-1]) + 1, int(counts.max())
        if (end - first) * cap - num <= PAD_ROWS_PER_SLOT * len(active):
            self.first_slot, self.num_groups, self.cap, self.segments = first, end - first, cap, []
            self.rows = self.num_groups * cap
            positions = (slot_of - first) * cap + (np.arange(num) - firsts[slot_of])
        else:
            self.segments = [(int(k), int(firsts[k]), int(firsts[k] + counts[k])) for k in active]
            self.rows = num
            positions = np.arange(num)
        self.in_order = self.rows == num and bool((tokens == positions).all())
        if self.in_order:
            return
        host = self._host_np
        host["gather"][:self.rows] = 0
        host["gather"][positions] = tokens
        host["tokens"][:num], host["positions"][:num] = tokens, positions
        self._step = {"gather": self._device["gather"][:self.rows], "tokens": self._device["tokens"][:num],
                      "positions": self._device["positions"][:num]}
        if self._device is not self._host:
            for name, tensor in self._step.items():
                tensor.copy_(self._host[name][:len(tensor)], non_blocking=True)

    def _sort_for_kernel(self, token_slots: np.ndarray, lora: np.ndarray) -> None:
        tokens = np.flatnonzero(lora)
        tokens = tokens[np.argsort(token_slots[tokens], kind="stable")]
        num = len(tokens)
        self._host_np["tokens"][:num], self._host_np["slots"][:num] = tokens, token_slots[tokens]
        self._step = {"tokens": self._host["tokens"][:num], "slots": self._host["slots"][:num]}

    def clear(self) -> None:
        self.has_lora = False

    def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor, weights: SlotWeights) -> None:
        """y[t] += x[t] @ lora_a[slot].T @ lora_b[slot].T, per output slice, for each token t with an adapter slot."""
        if self.kernels is not None:
            self.kernels.add_lora(y, x, self._step["tokens"], self._step["slots"], weights.lora_a_t, weights.lora_b,
                                  weights.slice_bounds)
            return
        for slot, start, end in self.runs:
            shrunk = torch.mm(x[start:end], weights.a_t_of[slot])
            y_run = y[start:end]
            for shrunk_cols, out_cols, b in zip(weights.shrunk_cols, weights.out_cols, weights.b_slices_of[slot]):
                y_run[:, out_cols].addmm_(shrunk[:, shrunk_cols], b)
        if self.num_grouped:
            self._add_grouped(y, x, weights)

    def _add_grouped(self, y: torch.Tensor, x: torch.Tensor, weights: SlotWeights) -> None:
        rows = self.rows
        grouped = x[:rows] if self.in_order else x.index_select(0, self._step["gather"])
        if self.segments:
            shrunk = x.new_empty(rows, weights.lora_a_t.shape[2])
            expanded = x.new_empty(rows, y.shape[1])
            for slot, start, end in self.segments:
                torch.mm(grouped[start:end], weights.a_t_of[slot], out=shrunk[start:end])
                for shrunk_cols, out_cols, b in zip(weights.shrunk_cols, weights.out_cols, weights.b_slices_of[slot]):
                    torch.mm(shrunk[start:end, shrunk_cols], b, out=expanded[start:end, out_cols])
        else:
            a_t, b_slices = weights.slot_range(self.first_slot, self.num_groups)
            shrunk = torch.bmm(grouped.view(self.num_groups, self.cap, -1), a_t)
            if len(b_slices) == 1:
                expanded = torch.bmm(shrunk, b_slices[0])
            else:  # one bmm per slice, side by side: a block-diagonal lora_b would cost n_slices x the FLOPs
                expanded = torch.cat([torch.bmm(shrunk[:, :, cols], b)
                                      for cols, b in zip(weights.shrunk_cols, b_slices)], dim=2)
            expanded = expanded.view(rows, -1)
        if self.in_order:
            y[:rows].add_(expanded)
            return
        if rows > self.num_grouped:  # the padded layout's padding rows stay behind
            expanded = expanded.index_select(0, self._step["positions"])
        y.index_add_(0, self._step["tokens"], expanded)
