"""OffloadingConnector: full blocks evicted from the device pool go to the node's host store (KVStore), and a later
prefix hit there is loaded back instead of recomputed.

Scheduler side: the block pool reports each cached block it evicts (on_block_evicted); the step that evicts it tells
the worker to copy it out before anything overwrites it. On admission, the blocks past the local prefix-cache hit are
looked up in the store; a hit loads asynchronously (the request waits in WAITING_FOR_REMOTE_KVS, the others run).
Worker side: start_load_kv copies the evicted blocks out (one object per step, indexed by the store) and then starts
the loads on a thread; a block gone from the store by then fails its load, and the scheduler recomputes from there.
Blocks are keyed by the prefix-cache hash (which starts from the request's LoRA adapter) in a namespace of the engine's
KV identity (model, dtype, quantization: raylm/configs/kv_identity.py) and cache layout, so any engine on the node
whose KV would be the same can load them, and no other.
"""
from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from raylm.common.kv_transfer import KVConnectorMetadata
from raylm.common.outputs import SchedulerOutput
from raylm.runner.kv_transfer.base import KVConnectorBase
from raylm.runner.kv_transfer.block_copy import gather_blocks, scatter_layer
from raylm.runner.kv_transfer.kv_store import kv_store_by_name, kv_store_name, node_kv_store

logger = logging.getLogger(__name__)
_GIB = 1 << 30


@dataclass
class OffloadingMetadata(KVConnectorMetadata):
    save_block_ids: list[int] = field(default_factory=list)  # evicted this step: copy out before the forward
    save_hashes: list[bytes] = field(default_factory=list)
    loads: dict[str, tuple[list[bytes], list[int]]] = field(default_factory=dict)  # request -> (hashes, block ids)


class OffloadingConnector(KVConnectorBase):
    # ---- scheduler side ------------------------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata: list[dict[str, Any] | None]) -> None:
        [worker] = metadata
        assert worker is not None
        self.namespace: str = worker["namespace"]
        self.store = kv_store_by_name(worker["store_name"])
        # Hashes this engine knows the store to hold (saved or found there), so that a block loaded back and evicted
        # again is not copied out twice; as many as the store has room for.
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._max_known = max(1, worker["capacity_bytes"] // worker["block_bytes"])
        self._saves: list[tuple[int, bytes]] = []
        self._found: dict[str, tuple[int, list[bytes]]] = {}  # request -> (first block, hashes found)
        self._loads: dict[str, tuple[list[bytes], list[int]]] = {}

    def on_block_evicted(self, block_id: int, block_hash: bytes) -> None:
        if block_hash in self._known:
            self._known.move_to_end(block_hash)
            return
        self._saves.append((block_id, block_hash))
        self._remember([block_hash])

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if request.sampling_params.prompt_logprobs is not None and request.num_output_tokens == 0:
            return 0, False  # every prompt position's logits are needed: nothing may be skipped
        first, last = num_computed_tokens // self.block_size, (request.num_tokens - 1) // self.block_size
        if first >= last:
            return 0, False
        hashes = request.block_hashes[first:last]  # the KV cache manager hashed them for its own lookup
        count = ray.get(self.store.lookup.remote(self.namespace, hashes))
        if count == 0:
            return 0, False
        self._found[request.request_id] = (first, hashes[:count])
        self._remember(hashes[:count])
        return count * self.block_size, True

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        found = self._found.pop(request.request_id, None)
        if num_external_tokens and found is not None:
            first, hashes = found
            self._loads[request.request_id] = (hashes, block_ids[first:first + len(hashes)])

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadingMetadata:
        metadata = OffloadingMetadata([block_id for block_id, _ in self._saves],
                                      [block_hash for _, block_hash in self._saves], self._loads)
        self._saves, self._loads, self._found = [], {}, {}
        return metadata

    def _remember(self, hashes: list[bytes]) -> None:
        for block_hash in hashes:
            self._known[block_hash] = None
            self._known.move_to_end(block_hash)
        while len(self._known) > self._max_known:
            self._known.popitem(last=False)

    # ---- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self.layers = list(kv_caches.values())
        self.block_bytes = sum(layer[:, 0].nbytes for layer in self.layers)
        size = self.config.kv_transfer_config.kv_offloading_size
        assert size is not None
        self.node_id = ray.get_runtime_context().get_node_id()
        self.store = node_kv_store(self.node_id)
        self.capacity_bytes = ray.get(self.store.ensure_capacity.remote(int(size * _GIB)))
        resolved = self.config.resolved
        shapes = [tuple(layer.shape[2:]) for layer in self.layers]
        self.namespace = hashlib.sha256(repr((resolved.kv_identity.digest, self.block_size, shapes,
                                              resolved.attention_backend)).encode()).hexdigest()[:16]
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="raylm-kv-offload")
        self._loader = ThreadPoolExecutor(2, thread_name_prefix="raylm-kv-load")
        self._lock = threading.Condition()
        self._finished_recving: set[str] = set()
        self._failed: dict[str, list[int]] = {}  # request -> its blocks not loaded, until its load is reported
        self._invalid: set[int] = set()
        self._num_loading = 0

    def get_handshake_metadata(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "store_name": kv_store_name(self.node_id),
                "capacity_bytes": self.capacity_bytes, "block_bytes": self.block_bytes}

    def start_load_kv(self, forward_context: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, OffloadingMetadata)
        if metadata.save_block_ids:
            # Now, before this step's loads and forward write into the blocks the scheduler handed out again.
            blocks = gather_blocks(self.layers, metadata.save_block_ids)
            self._saver.submit(self._save, metadata.save_hashes, blocks)
        for request_id, (hashes, block_ids) in metadata.loads.items():
            with self._lock:
                self._num_loading += 1
            self._loader.submit(self._load, request_id, hashes, block_ids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a request's blocks are loaded before it is scheduled."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        """Nothing to save: blocks are copied out when they are evicted, not as they are computed."""

    def wait_for_save(self) -> None:
        """Nothing to wait for: the evicted blocks were copied before the forward."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            recving, self._finished_recving = self._finished_recving, set()
            # A failed load's blocks go with its request's report, never a step before it.
            for request_id in recving:
                self._invalid.update(self._failed.pop(request_id, ()))
        return None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            invalid, self._invalid = self._invalid, set()
        return invalid

    def wait_for_transfers(self, timeout_s: float) -> None:
        with self._lock:
            if self._num_loading and not self._finished_recving:
                self._lock.wait(timeout_s)

    def shutdown(self) -> None:
        self._saver.shutdown(wait=True)
        self._loader.shutdown(wait=True)

    def _save(self, hashes: list[bytes], blocks: Any) -> None:
        try:
            ref = ray.put(blocks.swapaxes(0, 2).copy())  # [block, 2, layer, ...]: one per index
            ray.get(self.store.put_blocks.remote(self.namespace, hashes, [ref], self.block_bytes))
        except Exception:  # a lost save only costs a recompute later
            logger.exception("offloading %d KV blocks to the node's store failed", len(hashes))

    def _load(self, request_id: str, hashes: list[bytes], block_ids: list[int]) -> None:
        loaded = 0
        try:
            found = ray.get(self.store.get_blocks.remote(self.namespace, hashes))
            while loaded < len(found) and found[loaded] is not None:
                loaded += 1
            objects: dict[Any, Any] = {}
            for ref, _ in found[:loaded]:
                if ref[0] not in objects:
                    objects[ref[0]] = ray.get(ref[0])
            for layer_index, layer in enumerate(self.layers):
                for position in range(loaded):
                    ref, index = found[position]
                    scatter_layer(layer, [block_ids[position]], objects[ref[0]][index, :, layer_index][:, None])
        except Exception:
            logger.exception("loading %d offloaded KV blocks of request %s failed; they are recomputed",
                             len(hashes), request_id)
            loaded = 0
        with self._lock:
            self._failed[request_id] = block_ids[loaded:]
            self._finished_recving.add(request_id)
            self._num_loading -= 1
            self._lock.notify_all()
