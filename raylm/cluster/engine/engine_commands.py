"""What frontends send to AsyncLLM's engine thread, and how outputs travel back to their event loops."""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeAlias, TypeVar

from raylm.cluster.engine.llm_engine import LLMEngine, PromptType
from raylm.cluster.engine.output_processor import RequestOutputKind
from raylm.cluster.engine.outputs import PoolingRequestOutput, RequestOutput
from raylm.common.lora_request import LoRARequest
from raylm.common.pooling_params import PoolingParams
from raylm.common.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")


# What a request's stream carries: its outputs, or the error that ends it.
StreamItem: TypeAlias = "RequestOutput | PoolingRequestOutput | Exception"


@dataclass
class RequestStream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[StreamItem] = field(default_factory=asyncio.Queue)


@dataclass
class AddRequest:
    request_id: str
    prompt: PromptType
    params: SamplingParams | PoolingParams
    priority: int
    stream: RequestStream
    arrival_time: float
    lora_request: LoRARequest | None = None
    output_kind: RequestOutputKind = "delta"


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class CallEngine:
    """Run `fn(engine)` on the engine thread between steps (health checks; adapter loads, which reach the workers in
    step order). A ValueError fails this call only; any other error, or any error of a `fatal` call (a failed health
    check), also stops the engine."""

    fn: Callable[[LLMEngine], object]
    result: Future[object]
    fatal: bool = False


EngineCommand: TypeAlias = "AddRequest | AbortRequest | CallEngine"


def post_outputs(items: list[tuple[RequestStream, StreamItem]]) -> None:
    """Hands items to their streams' queues on the loops that own them (asyncio queues are not thread-safe),
    waking each loop once."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, StreamItem]]] = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream.queue, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:
            logger.warning("dropped %d outputs: their event loop is closed", len(batch))


def _put_all(items: list[tuple[asyncio.Queue, StreamItem]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def call_when_idle(cond: threading.Condition, busy: Callable[[], bool], fn: Callable[[], T], what: str) -> T:
    """Run `fn` (sleep, wake_up) on an idle engine from another thread. Holding `cond` keeps the engine thread from
    taking any new command, and an idle engine thread does nothing else with the engine."""
    with cond:
        if busy():
            raise RuntimeError(f"cannot {what}: requests are unfinished; let them finish or abort them first")
        return fn()
