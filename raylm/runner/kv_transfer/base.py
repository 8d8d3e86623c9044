"""KVConnectorBase: vLLM v1's KV connector interface (`KVConnectorBase_V1`), one class with two sides.

An engine holds two instances of its connector: the scheduler side (role SCHEDULER, in the engine core) and the worker
side (role WORKER, beside the KV cache). Per step, in this order (vLLM's):

    scheduler  get_num_new_matched_tokens(request, num_computed_tokens)   for each request it admits
               update_state_after_alloc(request, block_ids, num_external_tokens)   once its blocks are allocated
               build_connector_meta(scheduler_output) -> metadata         once per step, sent with the step
    worker     bind_connector_metadata(metadata)
               start_load_kv(forward_context)                             before the forward
               wait_for_layer_load(layer_name)                            in each attention layer, before attention
               save_kv_layer(layer_name, kv_layer, attn_metadata)         in each attention layer, after it writes KV
               wait_for_save()                                            after the forward
               get_finished(finished_req_ids) -> (sending, recving)       then the blocks whose load failed
               clear_connector_metadata()
    scheduler  update_connector_output(kv_connector_output)              with the step's ModelRunnerOutput
               request_finished(request, block_ids) -> (delay_free, kv_transfer_params)   when a request ends

A request whose external KV loads asynchronously (get_num_new_matched_tokens says so) waits for it in
WAITING_FOR_REMOTE_KVS and is scheduled once `get_finished` reports it received; blocks reported by
`get_block_ids_with_load_errors` are recomputed. A producer that returns delay_free keeps the request's blocks until
`get_finished` reports it sent. raylm passes block ids where vLLM passes KVCacheBlocks; a step without tokens still
runs the worker calls (no forward), so transfers finish while nothing computes.
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import Any

import torch

from raylm.common.kv_transfer import KVConnectorMetadata, KVConnectorOutput
from raylm.common.outputs import SchedulerOutput
from raylm.configs import EngineConfig


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


def kv_layer_name(layer_idx: int) -> str:
    """The name an attention layer's KV cache goes by in the connector calls."""
    return f"model.layers.{layer_idx}.self_attn.attn"


def kv_transfer_params(request: Any) -> dict[str, Any] | None:
    """The request's `kv_transfer_params` (vLLM's: from SamplingParams.extra_args)."""
    extra = request.sampling_params.extra_args
    return None if not extra else extra.get("kv_transfer_params")


class KVConnectorBase(ABC):
    def __init__(self, config: EngineConfig, role: KVConnectorRole) -> None:
        self.config = config
        self.role = role
        self.block_size = config.cache_config.block_size
        self._metadata: KVConnectorMetadata | None = None

    # ---- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """The KV cache of every attention layer, by layer name, in layer order; block ids index dim 1 of each."""
        self.kv_caches = kv_caches

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        assert self._metadata is not None, "no connector metadata is bound (bind_connector_metadata first)"
        return self._metadata

    @abstractmethod
    def start_load_kv(self, forward_context: Any) -> None:
        """Start this step's loads (and anything that must precede the forward); raylm passes None."""

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until the layer's KV for this step is loaded."""

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        """The layer has written this step's KV into kv_layer: start saving what must be saved."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """After the forward: every save this step needs is started (the KV cache may change after this)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Request ids whose sending / receiving finished since the last call."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call: their tokens are recomputed."""
        return set()

    def wait_for_transfers(self, timeout_s: float) -> None:  # noqa: B027 (optional)
        """raylm: a step without a forward waits here up to timeout_s for a transfer to finish, so an engine waiting
        only on transfers does not spin."""

    def get_handshake_metadata(self) -> dict[str, Any] | None:
        """What the scheduler side must know of this worker (set_xfer_handshake_metadata gets it)."""
        return None

    def shutdown(self) -> None:  # noqa: B027 (optional)
        """Stop background work."""

    # ---- scheduler side ------------------------------------------------------------------------

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens beyond the num_computed_tokens found locally whose KV the connector can provide, whether they load
        asynchronously). raylm's scheduler loads external KV asynchronously only."""

    @abstractmethod
    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """A request admitted: all its block ids (local hits first), of which num_external_tokens are to load."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's instructions to the worker side; resets the scheduler side's per-step state."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:  # noqa: B027 (optional)
        """What the worker side reported for a step."""

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """(keep the blocks until get_finished reports the request sent, kv_transfer_params for the caller)."""
        return False, None

    def sends_wait_for_peer(self) -> bool:
        """raylm: True when the blocks request_finished keeps (delay_free) wait for another engine to take them, not
        for this engine's own work: the engine does not step for them (offline, LLM.generate returns as its requests
        finish), and frees them at a later step once taken or timed out."""
        return False

    def set_xfer_handshake_metadata(self, metadata: list[dict[str, Any] | None]) -> None:  # noqa: B027 (optional)
        """Every worker's get_handshake_metadata, in rank order."""

    def on_block_evicted(self, block_id: int, block_hash: bytes) -> None:  # noqa: B027 (optional)
        """raylm: the block pool is about to hand out a block that held cached KV (its content is lost after this
        step's start_load_kv)."""
