"""The per-step control channel between an executor and its worker processes: one TCP connection per worker.

The executor pickles each request once and writes the same bytes to every connection; a worker answers on its own
connection. Sockets rather than Ray actor calls because a Ray call costs ~1 ms per worker per step, and rather than
shared memory because a blocked `recv` costs no CPU while the worker waits (spinning readers starve the model on a
small machine) and TCP reaches workers on other nodes with the same code.

Frames: an 8-byte little-endian length, then a pickle. A worker's first frame is its token and rank, as plain bytes:
the token, handed to workers through Ray, is checked before anything from a connection is unpickled.
"""
from __future__ import annotations

import hmac
import pickle
import secrets
import select
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

_HEADER = struct.Struct("<Q")
_HELLO = struct.Struct("<32sI")  # token (32 hex digits), rank
_PICKLE_PROTOCOL = 5


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def recv_frame(sock: socket.socket) -> bytearray:
    """One whole frame; ConnectionError when the peer has gone."""
    (length,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
    return _recv_exactly(sock, length)


def _recv_exactly(sock: socket.socket, num_bytes: int) -> bytearray:
    buffer = bytearray(num_bytes)
    view = memoryview(buffer)
    received = 0
    while received < num_bytes:
        n = sock.recv_into(view[received:])
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        received += n
    return buffer


def _tune(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small frames go out now, not after an ACK
    return sock


class DriverChannel:
    """The executor's end: listens on `host`, then holds one connection per worker rank."""

    def __init__(self, host: str, num_workers: int) -> None:
        self.num_workers = num_workers
        self.token = secrets.token_hex(16)
        self._listener = socket.create_server((host, 0))
        self.address: tuple[str, int] = (host, self._listener.getsockname()[1])
        self.sockets: list[socket.socket] = []

    def accept(self, timeout: float, still_starting: Callable[[], bool]) -> None:
        """Wait until every worker has connected; `still_starting()` is polled and returns False once waiting is
        pointless (a worker has died)."""
        deadline = time.monotonic() + timeout
        by_rank: dict[int, socket.socket] = {}
        self._listener.settimeout(0.5)
        while len(by_rank) < self.num_workers:
            if time.monotonic() > deadline or not still_starting():
                missing = sorted(set(range(self.num_workers)) - set(by_rank))
                raise RuntimeError(f"worker ranks {missing} did not connect to the control channel")
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            rank = self._read_hello(sock)
            if rank is None or not 0 <= rank < self.num_workers or rank in by_rank:
                sock.close()
                continue
            by_rank[rank] = _tune(sock)
        self._listener.close()
        self.sockets = [by_rank[rank] for rank in range(self.num_workers)]

    def _read_hello(self, sock: socket.socket) -> int | None:
        """The rank a new connection claims; None unless it shows the token."""
        sock.settimeout(5.0)  # a worker says hello right after connecting
        try:
            (length,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
            if length != _HELLO.size:
                return None
            token, rank = _HELLO.unpack(_recv_exactly(sock, _HELLO.size))
        except OSError:
            return None
        sock.settimeout(None)
        return rank if hmac.compare_digest(token, self.token.encode()) else None

    def broadcast(self, payload: bytes) -> None:
        frame = _HEADER.pack(len(payload)) + payload
        for sock in self.sockets:
            sock.sendall(frame)

    def close(self) -> None:
        self._listener.close()
        for sock in self.sockets:
            sock.close()


class WorkerChannel:
    """A worker's end (or a DP engine's, towards its client): receives requests and sends replies."""

    def __init__(self, address: tuple[str, int], rank: int, token: str, timeout: float = 60.0) -> None:
        self._sock = _tune(socket.create_connection(address, timeout=timeout))
        self._sock.settimeout(None)
        send_frame(self._sock, _HELLO.pack(token.encode(), rank))

    def recv(self) -> Any:
        return pickle.loads(recv_frame(self._sock))

    def poll(self, timeout: float | None) -> bool:
        """Whether a frame is waiting (within `timeout` seconds; None: wait for one)."""
        return bool(select.select([self._sock], [], [], timeout)[0])

    def send(self, obj: Any) -> None:
        send_frame(self._sock, pickle.dumps(obj, protocol=_PICKLE_PROTOCOL))

    def close(self) -> None:
        self._sock.close()
