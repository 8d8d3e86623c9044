"""What the scheduler and the prefix cache do for LoRA: at most max_loras distinct adapters per step (the device
slots), and block hashes that differ per adapter, so that the same prompt under two adapters never shares KV."""
from __future__ import annotations

import hashlib

from raylm.cluster.core.request import Request
from raylm.common.lora_request import LoRARequest


class LoRABatchLimit:
    """The distinct adapters of one step (vLLM's scheduled_loras); max_loras None: LoRA is off."""

    def __init__(self, max_loras: int | None) -> None:
        self.max_loras = max_loras
        self.lora_ids: set[int] = set()

    def admits(self, request: Request) -> bool:
        lora = request.lora_request
        return (lora is None or self.max_loras is None or lora.lora_int_id in self.lora_ids
                or len(self.lora_ids) < self.max_loras)

    def add(self, request: Request) -> None:
        if request.lora_request is not None:
            self.lora_ids.add(request.lora_request.lora_int_id)


def block_hash_seed(lora_request: LoRARequest | None) -> bytes | None:
    """The parent hash of a request's first block: None for the base model, else one per adapter (its id, name and
    path: ids are never reused for another adapter, so KV computed under a removed adapter is never hit)."""
    if lora_request is None:
        return None
    key = f"lora:{lora_request.lora_int_id}:{lora_request.lora_name}:{lora_request.lora_path}"
    return hashlib.sha256(key.encode()).digest()
