"""The step timeline: Chrome trace events (Perfetto opens them) of the engine's and every rank's phases.

Each process (an engine, a worker rank) keeps its own events in memory while tracing is on; the engine collects the
workers' at the end and writes one JSON file. Every event carries the step number, so the ranks of one step line up.
Off (the default), `span` hands back one shared do-nothing context: a function call per phase, nothing recorded.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any

_enabled = False
_pid = 0
_metadata: list[dict[str, Any]] = []  # this process's name and order, repeated in every drain
_events: list[dict[str, Any]] = []
_thread = threading.local()  # the current step, per thread (an engine may schedule ahead of its step thread)


class _NoSpan:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_SPAN = _NoSpan()


class _Span:
    __slots__ = ("name", "args", "start")

    def __init__(self, name: str, args: dict[str, Any]) -> None:
        self.name, self.args = name, args

    def __enter__(self) -> _Span:
        self.start = _now_us()
        return self

    def __exit__(self, *exc: object) -> None:
        _events.append({"name": self.name, "ph": "X", "ts": self.start, "dur": _now_us() - self.start, "pid": _pid,
                        "tid": threading.get_native_id(),
                        "args": {"step": getattr(_thread, "step", -1), **self.args}})


def _now_us() -> float:
    return time.time_ns() / 1000  # wall clock: comparable across the processes of one node


def enable(process_name: str, pid: int) -> None:
    """Record this process's spans from now on, as trace process `pid` named `process_name`. The first caller in a
    process names it (an engine whose worker runs in its own process keeps one timeline for both)."""
    global _enabled, _pid
    if _enabled:
        return
    _enabled, _pid = True, pid
    _metadata.extend([
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"{process_name} (pid {os.getpid()})"}},
        {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}},
    ])


def disable() -> None:
    """Stop recording and forget this process's events (a later engine in the process may trace anew)."""
    global _enabled, _events
    _enabled, _events = False, []
    _metadata.clear()


def is_enabled() -> bool:
    return _enabled


def set_step(step: int) -> None:
    """The step the following spans of this thread belong to."""
    _thread.step = step


def span(name: str, **args: Any) -> _Span | _NoSpan:
    """`with span("forward", num_tokens=n):` times the block as one event of the current step."""
    return _Span(name, args) if _enabled else _NO_SPAN


def drain() -> list[dict[str, Any]]:
    """This process's events since the last drain, after its name."""
    global _events
    events, _events = _events, []
    return [*_metadata, *events] if events else []
