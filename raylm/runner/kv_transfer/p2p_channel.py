"""A direct channel for a prefill worker's KV to a decode worker: a torch.distributed process group of two ranks per
(producer, consumer) pair, gloo on CPU and NCCL on CUDA, built beside the default group (never in it).

Pairing: the producer hosts a TCPStore on a free port of its node's IP; its kv_transfer_params carry that host and
port. A consumer connects to the store, takes a peer number n (`add("peers", 1)`) and asks to pair; both then build
the pair's group over `PrefixStore("pair/n")`, the producer rank 0 and the consumer rank 1. Requests go through the
store (a numbered queue the producer's listener thread reads in order), so a group only ever carries data both sides
have agreed to move: NCCL would otherwise sit on an idle receive until its watchdog fires. Per transfer the consumer
queues (key, first block, block count) and receives on the group a header (found or not, the layers' shape), then the
layers in order, each written into its blocks as it arrives. The producer's thread for that pair gathers each layer's
blocks from the held KV cache and sends it. A group that fails (peer gone, timeout) is dropped by both sides; the
consumer's next transfer from that producer pairs again.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import ray
import torch
from torch._C._distributed_c10d import Backend as PairGroup  # what ProcessGroupGloo / ProcessGroupNCCL are
from torch.distributed import PrefixStore, ProcessGroupGloo, Store, TCPStore

from raylm.runner.kv_transfer.block_copy import select_blocks, write_blocks

logger = logging.getLogger(__name__)

_HEADER = 8  # int64: found, number of layers, then the shape of one layer's blocks (up to 6 dims, 0-padded)
_IDLE_WAIT = timedelta(hours=1)  # the listener's wait for the next request (woken by requests and by close)


def pair_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def new_pair_group(store: Store, rank: int, device: torch.device, host: str, timeout: timedelta) -> PairGroup:
    """The two ranks' group (rank 0 the producer) over `store`; blocks until both have joined (or timeout)."""
    if device.type == "cuda":
        from torch.distributed import ProcessGroupNCCL  # only in CUDA builds of torch

        nccl = ProcessGroupNCCL.Options()
        nccl.is_high_priority_stream = False
        nccl._timeout = timeout
        with torch.cuda.device(device):
            return ProcessGroupNCCL(store, rank, 2, nccl)
    gloo = ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's stubs omit the options gloo takes
    gloo._timeout = timeout
    gloo._devices = [ProcessGroupGloo.create_device(hostname=host)]  # the interface peers reach this node on
    return ProcessGroupGloo(store, rank, 2, gloo)


def node_host() -> str:
    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


@dataclass
class _Offer:
    request_id: str
    block_ids: list[int]
    expires_at: float


class P2PProducer:
    """The prefill side: offers held blocks under transfer keys and sends them to the consumer that asks."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], timeout_s: float, on_sent: Callable[[str], None]) -> None:
        self.kv_caches = list(kv_caches.values())
        self.device = self.kv_caches[0].device
        self.timeout = timedelta(seconds=timeout_s)
        self.on_sent = on_sent
        self.host = node_host()
        self._server = TCPStore(self.host, 0, is_master=True, wait_for_workers=False, timeout=self.timeout)
        self._server.set("backend", pair_backend(self.device))
        self.port: int = self._server.port
        self._lock = threading.Lock()
        self._offers: dict[str, _Offer] = {}
        self._pairs: dict[int, queue.SimpleQueue[tuple[str, int, int] | None]] = {}
        self._listener = threading.Thread(target=self._listen, name="raylm-kv-p2p-listen", daemon=True)
        self._listener.start()

    def offer(self, key: str, request_id: str, block_ids: list[int]) -> None:
        with self._lock:
            self._offers[key] = _Offer(request_id, block_ids, time.monotonic() + self.timeout.total_seconds())

    def expire(self) -> set[str]:
        """Requests whose offer no consumer took in time: their blocks may go."""
        now = time.monotonic()
        with self._lock:
            gone = [key for key, offer in self._offers.items() if offer.expires_at < now]
            return {self._offers.pop(key).request_id for key in gone}

    def close(self) -> None:
        self._server.set(f"req/{self._server.add('requests', 1)}", json.dumps({"op": "close"}))
        self._listener.join(timeout=self.timeout.total_seconds())
        for pair in list(self._pairs.values()):
            pair.put(None)

    def _client(self, timeout: timedelta) -> TCPStore:
        """A connection of its own: a TCPStore client runs one call at a time, and the listener's wait holds its one."""
        return TCPStore(self.host, self.port, is_master=False, timeout=timeout)

    def _listen(self) -> None:
        store, number = self._client(_IDLE_WAIT), 1
        while True:
            name = f"req/{number}"
            try:
                store.wait([name])
            except RuntimeError:  # idle for _IDLE_WAIT; a client whose call timed out is not used again
                store = self._client(_IDLE_WAIT)
                continue
            request = json.loads(store.get(name))
            store.delete_key(name)
            number += 1
            if request["op"] == "close":
                return
            if request["op"] == "pair":
                self._pairs[request["peer"]] = queue.SimpleQueue()
                threading.Thread(target=self._serve, args=(request["peer"], self._pairs[request["peer"]]),
                                 name=f"raylm-kv-p2p-send-{request['peer']}", daemon=True).start()
            elif request["peer"] in self._pairs:
                self._pairs[request["peer"]].put((request["key"], request["first"], request["count"]))

    def _serve(self, peer: int, jobs: queue.SimpleQueue[tuple[str, int, int] | None]) -> None:
        try:
            store = PrefixStore(f"pair/{peer}", self._client(self.timeout))
            group = new_pair_group(store, 0, self.device, self.host, self.timeout)
            while (job := jobs.get()) is not None:
                self._send(group, *job)
        except Exception:
            logger.warning("KV pair %d dropped (its decode worker is gone or timed out)", peer, exc_info=True)
        finally:
            self._pairs.pop(peer, None)

    def _send(self, group: PairGroup, key: str, first: int, count: int) -> None:
        with self._lock:
            offer = self._offers.pop(key, None)
        header = torch.zeros(_HEADER, dtype=torch.int64)
        try:
            block_ids = [] if offer is None else offer.block_ids[first:first + count]
            if offer is not None and len(block_ids) == count:
                layer_shape = self.kv_caches[0].shape
                values = [1, len(self.kv_caches), layer_shape[0], count, *layer_shape[2:]]
                header[:len(values)] = torch.tensor(values)
            # torch's stubs omit Backend.send/recv (bound in C++ on every process group backend).
            _wait(group.send([header.to(self.device)], 1, 0), self.device, self.timeout)  # type: ignore[attr-defined]
            if header[0]:
                for kv_layer in self.kv_caches:  # in layer order: the consumer writes each as it comes
                    _wait(group.send([select_blocks(kv_layer, block_ids)], 1, 0),  # type: ignore[attr-defined]
                          self.device, self.timeout)
        finally:
            if offer is not None:
                self.on_sent(offer.request_id)  # sent or failed: the blocks may go either way


class P2PConsumer:
    """The decode side: one pair per producer address, made on first use and dropped when it fails."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], timeout_s: float) -> None:
        self.kv_caches = list(kv_caches.values())
        self.device = self.kv_caches[0].device
        self.timeout = timedelta(seconds=timeout_s)
        self.host = node_host()
        self._lock = threading.Lock()
        self._pairs: dict[tuple[str, int], _Pair] = {}

    def receive(self, host: str, port: int, key: str, first: int, block_ids: list[int]) -> bool:
        """Into block_ids the producer's blocks first.. of the transfer `key`, layer by layer: False when the producer
        no longer holds it; raises when the pair fails (the pair is dropped)."""
        with self._lock:
            pair = self._pairs.setdefault((host, port), _Pair(host, port, self))
        try:
            return pair.receive(key, first, block_ids)
        except Exception:
            with self._lock:
                if self._pairs.get((host, port)) is pair:
                    del self._pairs[(host, port)]
            raise

    def close(self) -> None:
        with self._lock:
            self._pairs.clear()


class _Pair:
    """The consumer's end of one pair; it pairs on its first transfer (outside the consumer's lock: a producer that
    does not answer delays only its own transfers)."""

    def __init__(self, host: str, port: int, consumer: P2PConsumer) -> None:
        self.host, self.port, self.consumer = host, port, consumer
        self.lock = threading.Lock()  # one transfer at a time on a group: its messages are matched in order
        self.store: TCPStore | None = None
        self.group: PairGroup | None = None
        self.peer = 0

    def _connect(self) -> tuple[TCPStore, PairGroup]:
        consumer = self.consumer
        store = TCPStore(self.host, self.port, is_master=False, timeout=consumer.timeout)
        backend = store.get("backend").decode()
        if backend != pair_backend(consumer.device):
            raise ValueError(f"the prefill worker sends over {backend}, this one's KV cache is on {consumer.device}")
        self.store, self.peer = store, store.add("peers", 1)
        self._request({"op": "pair"})
        group = new_pair_group(PrefixStore(f"pair/{self.peer}", store), 1, consumer.device, consumer.host,
                               consumer.timeout)
        return store, group

    def _request(self, request: dict[str, object]) -> None:
        assert self.store is not None
        self.store.set(f"req/{self.store.add('requests', 1)}", json.dumps(request | {"peer": self.peer}))

    def receive(self, key: str, first: int, block_ids: list[int]) -> bool:
        device, timeout, kv_caches = self.consumer.device, self.consumer.timeout, self.consumer.kv_caches
        with self.lock:
            if self.group is None:
                self.store, self.group = self._connect()
            self._request({"op": "send", "key": key, "first": first, "count": len(block_ids)})
            header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
            _wait(self.group.recv([header], 0, 0), device, timeout)  # type: ignore[attr-defined]  # as in _send
            found, num_layers, *dims = header.tolist()
            if not found:
                return False
            shape = (kv_caches[0].shape[0], len(block_ids), *kv_caches[0].shape[2:])
            if num_layers != len(kv_caches) or dims != [*shape, *[0] * (len(dims) - len(shape))]:
                raise ValueError(f"the prefill sends {num_layers} layers of blocks {dims}; here {len(kv_caches)} "
                                 f"of {list(shape)}")
            for kv_layer in kv_caches:
                blocks = torch.empty(shape, dtype=kv_layer.dtype, device=device)
                _wait(self.group.recv([blocks], 0, 0), device, timeout)  # type: ignore[attr-defined]  # as in _send
                write_blocks(kv_layer, block_ids, blocks)
            if device.type == "cuda":  # the blocks are written before the scheduler is told they arrived
                torch.cuda.current_stream(device).synchronize()
            return True


def _wait(work: torch.distributed.Work, device: torch.device, timeout: timedelta) -> None:
    """Until the message has gone or come; on CUDA Work.wait only orders the stream, so the CPU waits on it too."""
    work.wait(timeout)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
