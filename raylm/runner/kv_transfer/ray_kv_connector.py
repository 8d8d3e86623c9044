"""RayKVConnector: disaggregated prefill on Ray. A prefill engine (kv_producer) computes a prompt's KV; a decode engine
(kv_consumer) receives it and decodes, as vLLM's P/D connectors do.
The caller (the Serve PD proxy, any client) sends the prompt to the prefill engine (max_tokens 1, `do_remote_decode`),
then passes the kv_transfer_params its output names, with the same prompt, to a decode engine.

Producer, kv_transport object_store: in the step that completes the prompt, each attention layer's blocks are copied
out as soon as the layer has written them (save_kv_layer) and put into Ray's object store on a sender thread while the
next layers compute; wait_for_save then offers the layers under the transfer's key to the node's KVStore; the blocks
stay held (delay_free) until the puts are done. kv_transport p2p: wait_for_save offers the blocks themselves, held until
a decode worker has taken them over a direct channel (p2p_channel.py) or kv_transfer_timeout_s passes. Consumer: the
prompt's tokens but the last are external; the request waits in WAITING_FOR_REMOTE_KVS while a thread takes the
transfer the params name (from that KVStore, or from the prefill worker), layer by layer, into the blocks past its own
prefix-cache hit; the last prompt token is computed here and gives the first sampled token (never via a driver).

The pair check and a refused or missing transfer (recomputed, `kv_load_error`): docs/kv-connector.md.
"""
from __future__ import annotations

import logging
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import ray
import torch

from raylm.common.kv_transfer import KVConnectorOutput
from raylm.common.outputs import SchedulerOutput
from raylm.runner.kv_transfer.base import KVConnectorBase, KVConnectorRole, kv_transfer_params
from raylm.runner.kv_transfer.block_copy import gather_layer, scatter_layer
from raylm.runner.kv_transfer.kv_store import kv_store_by_name, kv_store_name, node_kv_store
from raylm.runner.kv_transfer.p2p_channel import P2PConsumer, P2PProducer
from raylm.runner.kv_transfer.ray_kv_metadata import RayKVMetadata, RecvJob, SendJob, pair_fields, pair_mismatch

logger = logging.getLogger(__name__)


@dataclass
class _Producing:
    num_prompt_tokens: int
    block_ids: list[int]
    sent: bool = False


class RayKVConnector(KVConnectorBase):
    def __init__(self, config: Any, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        kv_role = config.kv_transfer_config.kv_role
        self.is_producer = kv_role in ("kv_producer", "kv_both")
        self.is_consumer = kv_role in ("kv_consumer", "kv_both")
        self.timeout_s = config.kv_transfer_config.kv_transfer_timeout_s
        self.transport = config.kv_transfer_config.kv_transport
        self.num_layers = config.model_info.num_hidden_layers
        self.identity = config.resolved.kv_identity
        if role == KVConnectorRole.SCHEDULER:
            self.engine_id = uuid.uuid4().hex
            self._producing: dict[str, _Producing] = {}
            self._found: dict[str, tuple[int, dict[str, Any]]] = {}  # request -> (first block, its params)
            self._recvs: list[RecvJob] = []
            # Requests that used (or could not use) their params: a preempted one recomputes (vLLM's). A request
            # whose blocks could not be allocated yet asks again at the next step.
            self._consumed: set[str] = set()
            self._receiving: dict[str, set[int]] = {}  # request -> the blocks its transfer loads into
            self._load_errors: dict[str, str] = {}  # request -> why its prefill's KV was not (wholly) used

    # ---- scheduler side ------------------------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata: list[dict[str, Any] | None]) -> None:
        [worker] = metadata
        assert worker is not None
        self.source: dict[str, Any] = worker  # the params' fields saying where the KV is

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = kv_transfer_params(request)
        if (not self.is_consumer or not params or not params.get("do_remote_prefill")
                or request.request_id in self._consumed):
            return 0, False
        problem = pair_mismatch(request, params, self.identity, self.block_size, self.num_layers)
        if problem is not None:
            self._consumed.add(request.request_id)
            self._load_errors[request.request_id] = f"the prefill's KV was refused: {problem}"
            logger.warning("request %s: the prefill's KV is refused (%s); it is recomputed", request.request_id,
                           problem)
            return 0, False
        num_external = request.num_prompt_tokens - 1 - num_computed_tokens  # the last one gives the first token
        if num_external <= 0:
            self._consumed.add(request.request_id)
            return 0, False
        self._found[request.request_id] = (num_computed_tokens // self.block_size, params)
        return num_external, True

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        found = self._found.pop(request.request_id, None)
        if num_external_tokens and found is not None:
            first, params = found
            self._consumed.add(request.request_id)
            last = -(-(first * self.block_size + num_external_tokens) // self.block_size)
            source: dict[str, Any] = {name: params[name] for name in ("remote_store", "remote_host", "remote_port")
                                      if name in params}
            self._receiving[request.request_id] = set(block_ids[first:last])
            self._recvs.append(RecvJob(request.request_id, params["remote_transfer_key"], source, first,
                                       block_ids[first:last], self.timeout_s))
        own = kv_transfer_params(request)
        if self.is_producer and own and own.get("do_remote_decode"):
            self._producing[request.request_id] = _Producing(request.num_prompt_tokens, list(block_ids))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> RayKVMetadata:
        sends: list[SendJob] = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._producing.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids)
                self._maybe_send(new.req_id, state, new.num_computed_tokens + scheduled[new.req_id], sends)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_block_ids, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                       cached.num_computed_tokens):
            state = self._producing.get(req_id)
            if state is not None:
                state.block_ids.extend(new_block_ids)
                self._maybe_send(req_id, state, num_computed + scheduled[req_id], sends)
        metadata, self._recvs = RayKVMetadata(sends, self._recvs), []
        return metadata

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for request_id in connector_output.finished_recving:
            blocks = self._receiving.pop(request_id, set())
            if blocks & connector_output.invalid_block_ids:
                self._load_errors[request_id] = ("the prefill's KV did not arrive whole (the decode worker's log says "
                                                 "why); the rest was recomputed")

    def sends_wait_for_peer(self) -> bool:
        return self.transport == "p2p"  # held until a decode worker pulls them; object_store puts them itself

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._found.pop(request.request_id, None)
        self._consumed.discard(request.request_id)
        self._receiving.pop(request.request_id, None)
        error = self._load_errors.pop(request.request_id, None)
        state = self._producing.pop(request.request_id, None)
        if state is None or not state.sent:
            return False, None if error is None else {"kv_load_error": error}
        return True, self.source | {
            "do_remote_prefill": True, "remote_transfer_key": self._key(request.request_id),
            "remote_num_tokens": state.num_prompt_tokens, "remote_block_size": self.block_size,
            "remote_num_layers": self.num_layers, **pair_fields(request, self.identity)}

    def _maybe_send(self, request_id: str, state: _Producing, num_computed_after: int, sends: list[SendJob]) -> None:
        if state.sent or num_computed_after < state.num_prompt_tokens:
            return
        state.sent = True
        num_blocks = -(-state.num_prompt_tokens // self.block_size)
        sends.append(SendJob(request_id, self._key(request_id), state.block_ids[:num_blocks]))

    def _key(self, request_id: str) -> str:
        return f"{self.engine_id}/{request_id}"

    # ---- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self.node_id = ray.get_runtime_context().get_node_id()
        # p2p: the prefill worker serves its held blocks itself and nothing goes to the node's KVStore.
        p2p_producer = self.is_producer and self.transport == "p2p"
        self.store = None if self.transport == "p2p" else node_kv_store(self.node_id)
        self._producer = P2PProducer(kv_caches, self.timeout_s, self._sent) if p2p_producer else None
        self._consumer = P2PConsumer(kv_caches, self.timeout_s) if self.is_consumer else None  # if params say p2p
        self._sender = ThreadPoolExecutor(1, thread_name_prefix="raylm-kv-send")  # one: a job's puts, then its offer
        self._receiver = ThreadPoolExecutor(4, thread_name_prefix="raylm-kv-recv")
        self._lock = threading.Condition()
        self._finished_sending: set[str] = set()
        self._finished_recving: set[str] = set()
        self._failed: dict[str, list[int]] = {}  # request -> its blocks, while its failed load is not yet reported
        self._invalid: set[int] = set()

    def get_handshake_metadata(self) -> dict[str, Any]:
        if self._producer is not None:
            return {"remote_host": self._producer.host, "remote_port": self._producer.port}
        return {"remote_store": kv_store_name(self.node_id)}

    def start_load_kv(self, forward_context: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, RayKVMetadata)
        for job in metadata.recvs:
            self._receiver.submit(self._receive, job)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a request's KV is received before it is scheduled."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        if self._producer is None:  # p2p sends from the held blocks when a consumer asks
            self._save_layer(layer_name, kv_layer)

    def _save_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, RayKVMetadata)
        for job in metadata.sends:
            if layer_name not in job.refs:
                job.refs[layer_name] = []  # filled by the sender thread
                self._sender.submit(self._put, job, layer_name, gather_layer(kv_layer, job.block_ids))

    def wait_for_save(self) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, RayKVMetadata)
        if not metadata.sends:
            return
        if self._producer is not None:
            for job in metadata.sends:
                self._producer.offer(job.key, job.request_id, job.block_ids)
            return
        # Layers a captured CUDA graph ran without calling save_kv_layer are saved now.
        for layer_name, kv_layer in self.kv_caches.items():
            self._save_layer(layer_name, kv_layer)
        for job in metadata.sends:
            self._sender.submit(self._offer, job)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        expired = set() if self._producer is None else self._producer.expire()  # untaken p2p offers free their blocks
        with self._lock:
            sending, self._finished_sending = self._finished_sending | expired, set()
            recving, self._finished_recving = self._finished_recving, set()
            # A failed load's blocks go with its request's report, never a step before it.
            for request_id in recving:
                self._invalid.update(self._failed.pop(request_id, ()))
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            invalid, self._invalid = self._invalid, set()
        return invalid

    def wait_for_transfers(self, timeout_s: float) -> None:
        with self._lock:
            if not (self._finished_sending or self._finished_recving):
                self._lock.wait(timeout_s)

    def shutdown(self) -> None:
        self._sender.shutdown(wait=True)
        self._receiver.shutdown(wait=True)
        for channel in (self._producer, self._consumer):
            if channel is not None:
                channel.close()

    def _put(self, job: SendJob, layer_name: str, blocks: Any) -> None:
        try:
            job.refs[layer_name].append(ray.put(blocks))
        except Exception:  # the transfer goes out without this layer: the decode engine recomputes
            logger.exception("request %s: putting layer %s of its KV failed", job.request_id, layer_name)

    def _offer(self, job: SendJob) -> None:
        try:
            assert self.store is not None
            layers = {name: refs for name, refs in job.refs.items() if refs}
            ray.get(self.store.offer_transfer.remote(job.key, layers, len(self.kv_caches), self.timeout_s))
        except Exception:
            logger.exception("request %s: offering its KV to the node's store failed", job.request_id)
        self._sent(job.request_id)

    def _sent(self, request_id: str) -> None:
        with self._lock:
            self._finished_sending.add(request_id)
            self._lock.notify_all()

    def _receive(self, job: RecvJob) -> None:
        ok = False
        try:
            ok = self._receive_p2p(job) if "remote_host" in job.source else self._take_from_store(job)
        except Exception:
            logger.exception("request %s: receiving its prefill's KV failed; it is recomputed", job.request_id)
        with self._lock:
            if not ok:
                self._failed[job.request_id] = job.block_ids
            self._finished_recving.add(job.request_id)
            self._lock.notify_all()

    def _take_from_store(self, job: RecvJob) -> bool:
        taken = ray.get(kv_store_by_name(job.source["remote_store"]).take_transfer.remote(job.key, job.timeout_s))
        if taken is None:
            logger.warning("request %s: its prefill's KV did not come within %.0f s; it is recomputed",
                           job.request_id, job.timeout_s)
            return False
        if set(taken[0]) != set(self.kv_caches) or taken[1] != len(self.kv_caches):
            logger.warning("request %s: its prefill's KV has %d of %d layers; it is recomputed", job.request_id,
                           len(taken[0]), len(self.kv_caches))
            return False
        for layer_name, kv_layer in self.kv_caches.items():  # layer by layer, as each arrives
            blocks = ray.get(taken[0][layer_name][0])
            scatter_layer(kv_layer, job.block_ids, blocks[:, job.first_block:job.first_block + len(job.block_ids)])
        return True

    def _receive_p2p(self, job: RecvJob) -> bool:
        assert self._consumer is not None
        if self._consumer.receive(job.source["remote_host"], job.source["remote_port"], job.key, job.first_block,
                                  job.block_ids):
            return True
        logger.warning("request %s: its prefill worker no longer holds its KV; it is recomputed", job.request_id)
        return False
