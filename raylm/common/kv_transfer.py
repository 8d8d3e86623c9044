"""What KV connectors pass through the step contract (vLLM v1's shape): the scheduler side's per-step metadata to the
worker side, and the worker side's report of finished and failed transfers back to the scheduler."""
from __future__ import annotations

from dataclasses import dataclass, field


class KVConnectorMetadata:
    """One step's instructions from a connector's scheduler side to its worker side; each connector subclasses it."""


@dataclass
class KVConnectorOutput:
    """Request ids whose KV finished sending (their held blocks can be freed) or receiving (they can be scheduled),
    and the blocks whose load failed (their tokens are recomputed)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids)
