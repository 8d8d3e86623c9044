"""Calls to every worker over the control channel, answered through lazy futures.

A call is pickled once and broadcast; it names the ranks that must answer. Replies arrive on each connection in call
order, so a future resolves by reading replies until its own is in: no reader thread, and no thread hand-off on a
step's critical path. A worker that raises fails its call. If the call was a step (fatal), or a connection drops, or
the health monitor reports a death, every pending and later call fails: the workers may be out of step, so the
executor is finished.
"""
from __future__ import annotations

import itertools
import pickle
import select
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from raylm.executor.channel import DriverChannel, recv_frame


class RpcFuture(Future):
    def __init__(self, client: RpcClient) -> None:
        super().__init__()
        self._client = client

    def result(self, timeout: float | None = None) -> Any:
        self._client.wait(self, timeout)
        return super().result(timeout=0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._client.wait(self, timeout)
        return super().exception(timeout=0)

    def done(self) -> bool:
        if not super().done():
            self._client.poll()
        return super().done()


@dataclass
class _Call:
    future: RpcFuture
    method: str
    reply_ranks: tuple[int, ...]
    unwrap: bool  # resolve to the one reply instead of a list
    fatal: bool  # a failure ends the executor (a step: the ranks are now out of step)
    replies: dict[int, Any] = field(default_factory=dict)


class RpcClient:
    def __init__(self, channel: DriverChannel, worker_names: list[str],
                 find_dead_worker: Callable[[], str | None] = lambda: None) -> None:
        assert len(worker_names) == channel.num_workers == len(channel.sockets)
        self.channel = channel
        self.worker_names = worker_names
        # When a worker dies its peers fail too (a collective with a dead rank errors out): the failure reported
        # first names the dead worker, if there is one.
        self.find_dead_worker = find_dead_worker
        self.failure: str | None = None
        self._calls: dict[int, _Call] = {}
        self._seq = itertools.count()
        self._lock = threading.RLock()
        self._rank_of = {sock: rank for rank, sock in enumerate(channel.sockets)}
        # fail() writes here to wake a reader blocked in select.
        self._wake_reader, self._wake_writer = socket.socketpair()

    def call(self, method: str | bytes, args: tuple = (), kwargs: dict[str, Any] | None = None,
             reply_ranks: tuple[int, ...] = (), unwrap: bool = False, fatal: bool = False) -> RpcFuture:
        """Run `method` on every worker; the future holds the replies of `reply_ranks` (in that order), or the
        single reply when `unwrap`."""
        assert reply_ranks and (len(reply_ranks) == 1 or not unwrap)
        future = RpcFuture(self)
        name = method if isinstance(method, str) else "a function"
        with self._lock:
            if self.failure is not None:
                future.set_exception(RuntimeError(self.failure))
                return future
            seq = next(self._seq)
            self._calls[seq] = _Call(future, name, reply_ranks, unwrap, fatal)
            payload = pickle.dumps((seq, method, args, kwargs or {}, reply_ranks), protocol=pickle.HIGHEST_PROTOCOL)
            try:
                self.channel.broadcast(payload)
            except OSError as err:
                self._set_failure(f"could not send {name} to the workers ({err}): a worker died or exited")
                self._fail_pending()
        return future

    def fail(self, reason: str) -> None:
        """Fail every pending and later call; safe from any thread (the health monitor)."""
        self._set_failure(reason)
        try:
            self._wake_writer.send(b"\0")
        except OSError:
            pass  # closed: nobody is waiting

    def wait(self, future: RpcFuture, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not Future.done(future):
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"no reply from the workers within {timeout} s")
            self._pump(remaining)

    def poll(self) -> None:
        """Take in the replies already here, without blocking."""
        self._pump(0.0)

    def close(self) -> None:
        """Fail what is pending, tell the workers to stop serving (best effort) and close the connections."""
        self.fail("the executor is shut down")  # wakes a reader blocked in select, which frees the lock
        with self._lock:
            self._fail_pending()
            try:
                self.channel.broadcast(pickle.dumps(None))
            except OSError:
                pass  # a worker is gone; the executor kills them all next
            self.channel.close()
            self._wake_reader.close()
            self._wake_writer.close()

    def _pump(self, timeout: float | None) -> None:
        with self._lock:
            if self.failure is None:
                readable, _, _ = select.select([*self.channel.sockets, self._wake_reader], [], [], timeout)
                for sock in readable:
                    if sock is self._wake_reader:
                        sock.recv(4096)
                        continue
                    rank = self._rank_of[sock]
                    try:
                        seq, ok, value = pickle.loads(recv_frame(sock))
                    except OSError as err:
                        self._set_failure(self._with_cause(f"worker {self.worker_names[rank]} closed its control "
                                                           f"connection ({err}): it died or exited"))
                        break
                    self._on_reply(rank, seq, ok, value)
            if self.failure is not None:
                self._fail_pending()

    def _on_reply(self, rank: int, seq: int, ok: bool, value: Any) -> None:
        call = self._calls.get(seq)
        if call is None:
            return  # the call already failed
        if not ok:
            error = f"worker {self.worker_names[rank]} failed in {call.method}:\n{value}"
            if call.fatal:
                self._set_failure(self._with_cause(error))
            else:
                del self._calls[seq]
                call.future.set_exception(RuntimeError(error))
            return
        call.replies[rank] = value
        if len(call.replies) == len(call.reply_ranks):
            del self._calls[seq]
            replies = [call.replies[r] for r in call.reply_ranks]
            call.future.set_result(replies[0] if call.unwrap else replies)

    def _with_cause(self, reason: str) -> str:
        dead = self.find_dead_worker()
        return reason if dead is None else f"{dead}\n(then {reason})"

    def _set_failure(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason

    def _fail_pending(self) -> None:
        assert self.failure is not None
        calls, self._calls = self._calls, {}
        for call in calls.values():
            call.future.set_exception(RuntimeError(self.failure))
