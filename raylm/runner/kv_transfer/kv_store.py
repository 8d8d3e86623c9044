"""KVStore: one Ray actor per node, the host-memory side of the KV connectors of every engine on that node.

It holds no KV itself: the workers `ray.put` their blocks into the node's object store (shared memory) and hand it
the references, which keep the objects alive after the worker drops its own. So the data never passes through the
actor or an engine's driver and is read zero-copy on the node (or pulled by Ray from another node). An object lives
as long as the process that put it (Ray's ownership; Ray 2.56 removed `ray.put(_owner=...)`): blocks of an engine that
has stopped are lost, and a load of them fails and is recomputed.

Two tables:
- offloaded blocks (OffloadingConnector): (namespace, block hash) -> (object, index in it), least recently used first
  out once `capacity_bytes` is exceeded. The namespace keeps apart engines whose KV does not mix (another model,
  dtype, block size or layout).
- transfers (RayKVConnector): a prefill's KV, one object per layer, under a key, until a decode engine takes it or
  `expiry_s` passes.
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

NAMESPACE = "raylm"


@dataclass
class _Block:
    ref: list[Any]  # [ObjectRef]: one object holds several blocks
    index: int
    num_bytes: int


@dataclass
class _Transfer:
    layers: dict[str, list[Any]]  # layer name -> [ObjectRef]
    num_layers: int
    expires_at: float


@dataclass
class KVStore:
    capacity_bytes: int = 0
    blocks: OrderedDict[tuple[str, bytes], _Block] = field(default_factory=OrderedDict)
    used_bytes: int = 0
    num_evicted: int = 0
    transfers: dict[str, _Transfer] = field(default_factory=dict)
    arrivals: dict[str, asyncio.Event] = field(default_factory=dict)

    # ---- offloaded blocks ----------------------------------------------------------------------

    def ensure_capacity(self, capacity_bytes: int) -> int:
        """Grow to at least capacity_bytes (engines sharing the node may ask for different sizes); returns it."""
        self.capacity_bytes = max(self.capacity_bytes, capacity_bytes)
        return self.capacity_bytes

    def lookup(self, namespace: str, hashes: list[bytes]) -> int:
        """How many of `hashes`, from the first, are stored; those become the most recently used."""
        count = 0
        for block_hash in hashes:
            key = (namespace, block_hash)
            if key not in self.blocks:
                break
            self.blocks.move_to_end(key)
            count += 1
        return count

    def get_blocks(self, namespace: str, hashes: list[bytes]) -> list[tuple[list[Any], int] | None]:
        """For each hash, ([object], index of the block in it), or None where it is gone."""
        found: list[tuple[list[Any], int] | None] = []
        for block_hash in hashes:
            block = self.blocks.get((namespace, block_hash))
            found.append(None if block is None else (block.ref, block.index))
        return found

    def put_blocks(self, namespace: str, hashes: list[bytes], ref: list[Any], block_bytes: int) -> int:
        """Store the blocks of one object (block i is hashes[i]); evicts the least recently used beyond the capacity.
        Returns how many were stored (a block larger than the whole store is not)."""
        stored = 0
        for index, block_hash in enumerate(hashes):
            key = (namespace, block_hash)
            if key in self.blocks or block_bytes > self.capacity_bytes:
                continue
            self.blocks[key] = _Block(ref, index, block_bytes)
            self.used_bytes += block_bytes
            stored += 1
        while self.used_bytes > self.capacity_bytes:
            _, evicted = self.blocks.popitem(last=False)
            self.used_bytes -= evicted.num_bytes
            self.num_evicted += 1
        return stored

    def stats(self) -> dict[str, int]:
        return {"num_blocks": len(self.blocks), "used_bytes": self.used_bytes, "capacity_bytes": self.capacity_bytes,
                "num_evicted": self.num_evicted, "num_transfers": len(self.transfers)}

    def clear(self) -> None:
        self.blocks.clear()
        self.used_bytes = 0

    # ---- transfers -----------------------------------------------------------------------------

    def offer_transfer(self, key: str, layers: dict[str, list[Any]], num_layers: int, expiry_s: float) -> None:
        """A prefill's KV under `key`: [ObjectRef] per layer saved (num_layers expected; fewer is a partial one)."""
        self._expire()
        self.transfers[key] = _Transfer(layers, num_layers, time.monotonic() + expiry_s)
        event = self.arrivals.pop(key, None)
        if event is not None:
            event.set()

    async def take_transfer(self, key: str, timeout_s: float) -> tuple[dict[str, list[Any]], int] | None:
        """The transfer under `key` (its layers, and how many were expected), removed; waits up to timeout_s for it to
        be offered. None when it did not come."""
        self._expire()
        if key not in self.transfers:
            event = self.arrivals.setdefault(key, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), timeout_s)
            except asyncio.TimeoutError:
                self.arrivals.pop(key, None)
                return None
        transfer = self.transfers.pop(key, None)
        return None if transfer is None else (transfer.layers, transfer.num_layers)

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [key for key, transfer in self.transfers.items() if transfer.expires_at < now]:
            del self.transfers[key]


def kv_store_name(node_id: str) -> str:
    return f"raylm-kv-store-{node_id}"


def node_kv_store(node_id: str | None = None) -> Any:
    """The KVStore actor of a node (this process's node by default), started on it if there is none yet. Detached:
    it serves every engine on the node and outlives each of them."""
    node_id = node_id or ray.get_runtime_context().get_node_id()
    return ray.remote(KVStore).options(
        name=kv_store_name(node_id), namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0,
        max_concurrency=1000, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote()


def kv_store_by_name(name: str) -> Any:
    return ray.get_actor(name, namespace=NAMESPACE)
