"""The worker-side adapter manager (vLLM's LRUCacheWorkerLoRAManager): adapters in host memory, least recently used
evicted past max_cpu_loras, and max_loras device slots that every LoRA layer of the model shares.

Each step, the adapters of the batch's rows are put in slots (loaded from disk first when the host cache lacks them,
since a request carries its adapter's path), slots of adapters the step does not use being reused; then every token
gets its row's slot (the PunicaWrapper's mask). A request's adapter stays loadable after it is removed from the
caches, so removing an adapter never breaks a request in flight.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np
import torch

from raylm.common.lora_request import LoRARequest
from raylm.configs.engine_config import LoRAConfig
from raylm.runner import cpu_kernels
from raylm.runner.layers.linear import LinearBase
from raylm.runner.lora.layers import LoRASlots
from raylm.runner.lora.peft_checkpoint import LoRAModel, load_lora_model
from raylm.runner.lora.punica import PunicaWrapper

if TYPE_CHECKING:
    from raylm.runner.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: LlamaForCausalLM, lora_config: LoRAConfig, max_num_tokens: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        assert lora_config.max_cpu_loras is not None, "a resolved LoRAConfig decides max_cpu_loras"
        self.max_loras, self.max_rank = lora_config.max_loras, lora_config.max_lora_rank
        self.max_cpu_loras, self.dtype = lora_config.max_cpu_loras, dtype
        self.hf_config = model.config
        self.punica = PunicaWrapper(max_num_tokens, self.max_loras, device, cpu_kernels.ops_for_kind(device, dtype))
        # PEFT module kind -> (raylm module kind, slice): q/k/v fill qkv_proj's slices, gate/up gate_up_proj's.
        self.packed: dict[str, tuple[str, int]] = {}
        for packed_name, parts in getattr(model, "packed_modules_mapping", {}).items():
            self.packed.update({part: (packed_name, i) for i, part in enumerate(parts)})
        self.layers: dict[str, LoRASlots] = {}
        for name, module in model.named_modules():
            kind = name.rsplit(".", 1)[-1]
            if isinstance(module, LinearBase) and kind in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                module.lora = self.layers[name] = LoRASlots(module, self.punica, self.max_loras, self.max_rank,
                                                                 dtype, device)
        self.cpu_cache: OrderedDict[int, LoRAModel] = OrderedDict()  # least recently used first
        self.slot_ids: list[int | None] = [None] * self.max_loras
        self.num_disk_loads = 0  # adapters read from disk
        self.num_slot_loads = 0  # adapters copied into a device slot

    # ---- the host cache -----------------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read the adapter into the host cache (checked against the model); False if it was there already."""
        if lora_request.lora_int_id in self.cpu_cache:
            self.cpu_cache.move_to_end(lora_request.lora_int_id)
            return False
        self._load(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Drop the adapter from the host cache and its device slot; False if neither held it."""
        found = self.cpu_cache.pop(lora_id, None) is not None
        if lora_id in self.slot_ids:
            self._free_slot(self.slot_ids.index(lora_id))
            found = True
        return found

    def list_loras(self) -> set[int]:
        return set(self.cpu_cache)

    def _load(self, lora_request: LoRARequest, keep: frozenset[int] = frozenset()) -> LoRAModel:
        lora = load_lora_model(lora_request.lora_name, lora_request.lora_path, self.hf_config, self.max_rank,
                               self.dtype)
        self.num_disk_loads += 1
        while len(self.cpu_cache) >= self.max_cpu_loras:
            # The least recently used adapter the current step does not need; its device slot goes with it.
            victim = next((i for i in self.cpu_cache if i not in keep), None)
            if victim is None:
                break
            self.remove_lora(victim)
        self.cpu_cache[lora_request.lora_int_id] = lora
        return lora

    # ---- the device slots ---------------------------------------------------------------------

    def set_active_loras(self, lora_requests: list[LoRARequest]) -> dict[int, int]:
        """Put the step's adapters (at most max_loras) in device slots; returns adapter id -> slot."""
        if len(lora_requests) > self.max_loras:
            raise RuntimeError(f"a step holds {len(lora_requests)} adapters, over max_loras ({self.max_loras}): the "
                               f"scheduler admits at most max_loras per step")
        needed = frozenset(request.lora_int_id for request in lora_requests)
        slots: dict[int, int] = {}
        for request in lora_requests:
            lora_id = request.lora_int_id
            lora = self.cpu_cache.get(lora_id)
            if lora is None:
                lora = self._load(request, keep=needed)
            self.cpu_cache.move_to_end(lora_id)
            if lora_id in self.slot_ids:
                slots[lora_id] = self.slot_ids.index(lora_id)
                continue
            slot = self._slot_to_fill(needed)
            self._fill_slot(slot, lora_id, lora)
            slots[lora_id] = slot
        return slots

    def _slot_to_fill(self, needed: frozenset[int]) -> int:
        """An empty slot, else the slot of the least recently used adapter the step does not need."""
        if None in self.slot_ids:
            return self.slot_ids.index(None)
        recency: dict[int | None, int] = {lora_id: i for i, lora_id in enumerate(self.cpu_cache)}
        candidates = [i for i, held in enumerate(self.slot_ids) if held not in needed]
        return min(candidates, key=lambda i: recency.get(self.slot_ids[i], -1))

    def _fill_slot(self, slot: int, lora_id: int, lora: LoRAModel) -> None:
        by_layer: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]] = {
            name: [None] * len(layer.output_slices) for name, layer in self.layers.items()}
        for module, weights in lora.layers.items():
            prefix, kind = module.rsplit(".", 1)
            packed_kind, index = self.packed.get(kind, (kind, 0))
            name = f"{prefix}.{packed_kind}"
            if name in by_layer:  # not when another pipeline stage owns the layer
                by_layer[name][index] = (weights.lora_a, weights.lora_b)
        for name, layer in self.layers.items():
            layer.set_lora(slot, by_layer[name])
        self.slot_ids[slot] = lora_id
        self.num_slot_loads += 1

    def _free_slot(self, slot: int) -> None:
        for layer in self.layers.values():
            layer.reset_lora(slot)
        self.slot_ids[slot] = None

    # ---- one step -----------------------------------------------------------------------------

    def prepare(self, row_lora_ids: np.ndarray, lora_requests: dict[int, LoRARequest],
                num_scheduled: np.ndarray) -> bool:
        """The step's rows use adapters row_lora_ids (0: none) and schedule num_scheduled tokens each: put the
        adapters in slots and give every token its slot. Returns has_lora."""
        ids, inverse = np.unique(row_lora_ids, return_inverse=True)
        if not ids.any():
            self.punica.clear()
            return False
        slots = self.set_active_loras([lora_requests[int(i)] for i in ids if i])
        slot_of_id = np.array([slots.get(int(i), -1) for i in ids], dtype=np.int64)
        self.punica.update(np.repeat(slot_of_id[inverse], num_scheduled))
        return True
