"""KVTransferTracker: the scheduler's part in KV transfers, around the engine's scheduler-side KV connector.

- A request whose KV the connector can provide waits for it in WAITING_FOR_REMOTE_KVS, holding its blocks, outside the
  waiting queue, so the requests behind it are admitted meanwhile. When the worker reports it received, it rejoins the
  scheduler's admission, ahead of the waiting queue, with its tokens computed up to the first block whose load failed
  (all of them when none did): a failed load is recomputed.
- A finished request whose blocks the connector still sends from (delay_free) keeps them until the worker reports it
  sent; one aborted while receiving keeps them until its load ends, since the load still writes into them. Sends that
  wait for another engine to take the blocks (sends_wait_for_peer: RayKVConnector over p2p) do not keep the engine
  stepping: offline, the prefill's LLM.generate returns as its requests finish, and the decode engine then pulls the
  blocks; they are freed at the engine's next step.
"""
from __future__ import annotations

import logging
from typing import Any

from raylm.cluster.core.block_pool import KVCacheBlock
from raylm.cluster.core.kv_cache_manager import KVCacheManager
from raylm.cluster.core.request import Request, RequestStatus
from raylm.cluster.core.request_queue import FCFSRequestQueue, RequestQueue
from raylm.common.kv_transfer import KVConnectorOutput
from raylm.runner.kv_transfer import KVConnectorBase

logger = logging.getLogger(__name__)


class KVTransferTracker:
    def __init__(self, connector: KVConnectorBase, kv_cache_manager: KVCacheManager) -> None:
        self.connector = connector
        self.kv_cache_manager = kv_cache_manager
        self.receiving: dict[str, Request] = {}
        self.num_local_tokens: dict[str, int] = {}  # receiving request -> its tokens computed here (prefix hits)
        self.ready = FCFSRequestQueue()  # received (or failed), holding their blocks: admitted before the waiting
        self.sending: dict[str, Request] = {}  # finished, blocks held until sent
        self.sent_early: set[str] = set()  # reported sent before the request finished
        self.aborted: dict[str, Request] = {}  # aborted while receiving, blocks held until the load ends
        self.num_received_tokens = 0  # tokens whose KV arrived and was used
        self.num_failed_loads = 0  # requests that recompute (part of) what was to arrive

    def has_pending(self) -> bool:
        sending = bool(self.sending) and not self.connector.sends_wait_for_peer()
        return bool(self.receiving or self.ready or sending or self.aborted)

    def admission_queue(self, waiting: RequestQueue) -> RequestQueue:
        """Requests whose external KV arrived (or failed) are admitted first: they hold their blocks, so behind a
        request that cannot fit while they do, they would wait for good."""
        return self.ready if self.ready else waiting

    def try_receive(self, request: Request, computed_blocks: list[KVCacheBlock], num_computed_tokens: int
                    ) -> bool | None:
        """A request being admitted with num_computed_tokens found locally: True if the connector offers more and it
        now waits for them (its blocks allocated), None if there is no room for those blocks yet, False if the
        connector offers nothing."""
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_computed_tokens)
        if not num_external:
            return False
        if not load_async:
            raise RuntimeError(f"{type(self.connector).__name__} offers {num_external} tokens of KV to load "
                               f"synchronously; raylm's scheduler loads external KV asynchronously only")
        if self.kv_cache_manager.allocate_slots(request, num_external, num_computed_tokens, computed_blocks,
                                                delay_cache_blocks=True) is None:
            return None
        self._start_receiving(request, num_computed_tokens, num_external)
        return True

    def _start_receiving(self, request: Request, num_computed_tokens: int, num_external_tokens: int) -> None:
        """Its blocks for the local and the external tokens are allocated; it waits for the external ones."""
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = num_computed_tokens + num_external_tokens
        self.receiving[request.request_id] = request
        self.num_local_tokens[request.request_id] = num_computed_tokens
        self.after_alloc(request, num_external_tokens)

    def after_alloc(self, request: Request, num_external_tokens: int = 0) -> None:
        self.connector.update_state_after_alloc(
            request, self.kv_cache_manager.get_block_ids(request.request_id), num_external_tokens)

    def discard(self, request: Request) -> bool:
        """A request finished (aborted) while the tracker holds it: True if it did."""
        if self.receiving.pop(request.request_id, None) is not None:
            del self.num_local_tokens[request.request_id]
            self.aborted[request.request_id] = request
            return True
        try:
            self.ready.remove(request)
        except ValueError:  # not there
            return False
        return True

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """The connector's say on a finished request: (keep its blocks for now, kv_transfer_params for the caller)."""
        delay_free, params = self.connector.request_finished(
            request, self.kv_cache_manager.get_block_ids(request.request_id))
        request_id = request.request_id
        if request_id in self.aborted:
            return True, params  # freed when its load ends
        if delay_free:
            if request_id in self.sent_early:
                self.sent_early.discard(request_id)
                return False, params
            self.sending[request_id] = request
        return delay_free, params

    def update(self, output: KVConnectorOutput) -> None:
        """What the workers reported for a step (after the step's requests were updated)."""
        self.connector.update_connector_output(output)
        for request_id in output.finished_sending:
            request = self.sending.pop(request_id, None)
            if request is None:
                self.sent_early.add(request_id)
            else:
                self.kv_cache_manager.free(request)
        for request_id in output.finished_recving:
            aborted = self.aborted.pop(request_id, None)
            if aborted is not None:
                self.kv_cache_manager.free(aborted)
            request = self.receiving.pop(request_id, None)
            if request is not None:
                self._received(request, output.invalid_block_ids)

    def _received(self, request: Request, invalid_block_ids: set[int]) -> None:
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        failed = [index for index, block_id in enumerate(block_ids) if block_id in invalid_block_ids]
        num_expected, num_local = request.num_computed_tokens, self.num_local_tokens.pop(request.request_id)
        if failed:
            request.num_computed_tokens = max(num_local, min(num_expected,
                                                             failed[0] * self.kv_cache_manager.block_size))
            self.num_failed_loads += 1
            logger.warning("request %s: %d of its %d tokens' KV to load did not arrive; they are recomputed",
                           request.request_id, num_expected - request.num_computed_tokens, num_expected - num_local)
        self.num_received_tokens += request.num_computed_tokens - num_local
        request.status = RequestStatus.WAITING
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = request.num_computed_tokens
        self.ready.add(request)
