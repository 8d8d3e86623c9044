"""The control plane without Ray: an RpcClient and two workers' run loops (threads) over the TCP channel."""
from __future__ import annotations

import pickle
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from raylm.executor.channel import DriverChannel, WorkerChannel, send_frame
from raylm.executor.ray_worker import RayWorkerWrapper
from raylm.executor.rpc import RpcClient


class FakeWorker:
    """Answers (rank, method); `actions` maps a rank to what it does instead: "fail" or "block"."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.release = threading.Event()

    def execute_method(self, method: str, actions: dict[int, str] | None = None) -> Any:
        action = (actions or {}).get(self.rank)
        if action == "fail":
            raise ZeroDivisionError(f"rank {self.rank} fails")
        if action == "block":
            self.release.wait(10)
        return self.rank, method


@contextmanager
def control_plane(manual_rank: int | None = None) -> Iterator[tuple[RpcClient, WorkerChannel | None]]:
    """An RpcClient over two workers: run loops in threads, except `manual_rank`, whose end the test holds."""
    channel = DriverChannel("127.0.0.1", 2)
    stray = socket.create_connection(channel.address)  # a connection without the token is turned away
    send_frame(stray, pickle.dumps(("wrong token", 0)))
    fakes = [FakeWorker(rank) for rank in range(2)]
    manual = None
    for rank, fake in enumerate(fakes):
        if rank == manual_rank:
            manual = WorkerChannel(channel.address, rank, channel.token)
            continue
        wrapper = RayWorkerWrapper(rank)
        wrapper.worker = fake
        threading.Thread(target=wrapper.run, args=(channel.address, channel.token), daemon=True).start()
    channel.accept(timeout=10, still_starting=lambda: True)
    client = RpcClient(channel, ["rank 0", "rank 1"])
    try:
        yield client, manual
    finally:
        for fake in fakes:
            fake.release.set()
        client.close()
        stray.close()


@pytest.fixture
def client() -> Iterator[RpcClient]:
    with control_plane() as (client, _):
        yield client


def test_replies_resolve_in_any_order(client: RpcClient) -> None:
    futures = [client.call(f"echo{i}", reply_ranks=(0, 1)) for i in range(5)]
    last = client.call("last", reply_ranks=(1, 0))
    assert last.result(timeout=5) == [(1, "last"), (0, "last")]  # in reply_ranks order
    assert all(future.done() for future in futures)  # each rank answered them before the later one
    assert client.call("one", reply_ranks=(1,), unwrap=True).result(timeout=5) == (1, "one")
    assert [future.result() for future in futures] == [[(0, f"echo{i}"), (1, f"echo{i}")] for i in range(5)]


def test_an_error_fails_only_its_call(client: RpcClient) -> None:
    with pytest.raises(RuntimeError, match="(?s)worker rank 1 failed in probe:.*ZeroDivisionError"):
        client.call("probe", ({1: "fail"},), reply_ranks=(0, 1)).result(timeout=5)
    assert client.call("echo", reply_ranks=(0,), unwrap=True).result(timeout=5) == (0, "echo")


def test_an_error_in_a_step_fails_every_call(client: RpcClient) -> None:
    # Only rank 0 answers a step, but rank 1 failing (while rank 0 waits on it) must end the step.
    with pytest.raises(RuntimeError, match="worker rank 1 failed in step"):
        client.call("step", ({0: "block", 1: "fail"},), reply_ranks=(0,), unwrap=True, fatal=True).result(timeout=5)
    with pytest.raises(RuntimeError, match="worker rank 1 failed in step"):
        client.call("echo", reply_ranks=(0,), unwrap=True).result(timeout=5)


def test_a_dropped_connection_wakes_a_blocked_caller() -> None:
    with control_plane(manual_rank=1) as (client, rank1):
        assert rank1 is not None
        blocked = client.call("step", ({0: "block"},), reply_ranks=(0,), unwrap=True, fatal=True)
        assert rank1.recv()[1] == "step"
        threading.Timer(0.1, rank1.close).start()  # rank 1 dies while the caller waits on rank 0
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="worker rank 1 closed its control connection"):
            blocked.result(timeout=5)
        assert time.monotonic() - start < 1.0


def test_fail_from_another_thread_wakes_a_blocked_caller(client: RpcClient) -> None:
    blocked = client.call("step", ({0: "block", 1: "block"},), reply_ranks=(0, 1))
    threading.Timer(0.1, client.fail, ("the monitor saw rank 0 die",)).start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="the monitor saw rank 0 die"):
        blocked.result(timeout=5)
    assert time.monotonic() - start < 1.0
    assert client.call("echo", reply_ranks=(0,)).exception(timeout=0) is not None  # later calls fail at once
