"""The scheduling policy: the order in which waiting requests are admitted, and which running request is
preempted first."""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Protocol

from raylm.cluster.core.request import Request


class RequestQueue(Protocol):
    def add(self, request: Request) -> None: ...

    def add_preempted(self, request: Request) -> None: ...

    def peek(self) -> Request: ...

    def pop(self) -> Request: ...

    def remove(self, request: Request) -> None: ...

    def __len__(self) -> int: ...


class FCFSRequestQueue:
    """Arrival order; a preempted request goes back to the front (it arrived before any waiter)."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)


class PriorityRequestQueue:
    """Smallest (priority, arrival_time) first; a preempted request simply rejoins by that key."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._tiebreak = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._tiebreak), request))

    def add_preempted(self, request: Request) -> None:
        self.add(request)

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)


def create_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"unknown scheduling_policy {policy!r}: expected 'fcfs' or 'priority'")


def preemption_victim(running: list[Request], policy: str) -> int:
    """Index in `running` of the request to preempt: the last admitted (fcfs), or the least urgent, i.e. the one
    with the largest (priority, arrival_time) (priority)."""
    if policy == "fcfs":
        return len(running) - 1
    return max(range(len(running)), key=lambda i: (running[i].priority, running[i].arrival_time))
