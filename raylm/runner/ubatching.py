"""Dual batch overlap (DBO): the micro-batches (ubatches) of one forward run on threads of their own that hand off
to each other at the MoE all_to_alls (vLLM's UBatchContext and UBatchWrapper).

Strict ping-pong: exactly one ubatch thread runs at a time, and it gives the turn away only in `dbo_yield`, right
after starting an async collective; the other ubatch computes while that collective is in flight, then yields back.
Ubatch 0 always runs first and the yields sit at the same places of the same model in both threads, so every rank
issues the same collectives in the same order on every process group (gloo pairs the collectives of a group by
their issue order), and ubatch 0 reaches each layer's attention before ubatch 1 reads the K/V it wrote there.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from raylm.common.outputs import IntermediateTensors
from raylm.runner.attention.backend import AttentionBackend
from raylm.runner.attention.common import CommonAttentionMetadata
from raylm.runner.batch_descriptor import BatchDescriptor
from raylm.runner.forward_context import set_forward_context
from raylm.runner.input_buffers import InputBuffers
from raylm.runner.ubatch_splitting import UBatchSlice, slice_attn_metadata, slice_tensors

T = TypeVar("T")


class UBatchContext:
    """One ubatch thread's turn-taking. `cpu_wait_event` is set when it is this thread's turn; `cpu_signal_event`
    is the next ubatch's."""

    def __init__(self, ubatch_id: int, cpu_wait_event: threading.Event, cpu_signal_event: threading.Event) -> None:
        self.id = ubatch_id
        self.cpu_wait_event = cpu_wait_event
        self.cpu_signal_event = cpu_signal_event
        self.done = False
        self.next: UBatchContext | None = None

    def __enter__(self) -> UBatchContext:
        _local.context = self
        self._wait_turn()
        return self

    def __exit__(self, *exc: object) -> None:
        # Done before signalling: the next ubatch, once running, must not wait for a turn that never comes.
        self.done = True
        _local.context = None
        self.cpu_signal_event.set()

    def yield_(self) -> None:
        """Hand the turn to the next ubatch and wait for it to come back; alone (the other one finished), go on."""
        assert self.next is not None
        if self.next.done:
            return
        self.cpu_signal_event.set()
        self._wait_turn()

    def _wait_turn(self) -> None:
        self.cpu_wait_event.wait()
        self.cpu_wait_event.clear()


class _Local(threading.local):
    context: UBatchContext | None = None


_local = _Local()


def current_ubatch_id() -> int | None:
    """The ubatch this thread runs, or None outside micro-batching."""
    context = _local.context
    return None if context is None else context.id


def dbo_enabled() -> bool:
    return _local.context is not None


def dbo_yield() -> None:
    """Let the other ubatch run (a no-op outside micro-batching)."""
    context = _local.context
    if context is not None:
        context.yield_()


def run_ubatches(forwards: Sequence[Callable[[], T]], attn_metadata: Sequence[Any], num_tokens: Sequence[int],
                 batch_descriptor: BatchDescriptor | None, device: torch.device) -> list[T]:
    """forwards[i]() on thread i under its own forward context, in ping-pong from ubatch 0; results in ubatch order.
    An exception in a ubatch ends its turns (the other goes on alone) and is raised here."""
    n = len(forwards)
    events = [threading.Event() for _ in range(n)]
    contexts = [UBatchContext(i, events[i], events[(i + 1) % n]) for i in range(n)]
    for i, context in enumerate(contexts):
        context.next = contexts[(i + 1) % n]
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # the current device is per thread
            # Inference mode is per thread too.
            with torch.inference_mode(), contexts[i], set_forward_context(attn_metadata[i], num_tokens[i],
                                                                           batch_descriptor):
                results[i] = forwards[i]()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,), name=f"ubatch-{i}", daemon=True) for i in range(n)]
    for thread in threads:
        thread.start()
    events[0].set()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def forward_in_ubatches(model: torch.nn.Module, buffers: InputBuffers, attn_backend: AttentionBackend,
                        batch_descriptor: BatchDescriptor, ubatch_slices: list[UBatchSlice],
                        common: CommonAttentionMetadata | None, intermediate_tensors: IntermediateTensors | None
                        ) -> torch.Tensor | IntermediateTensors:
    """One forward as micro-batches: each ubatch on its own thread with its own attention metadata, outputs
    concatenated in token order (the rows an unsliced forward gives)."""
    tensors = None if intermediate_tensors is None else intermediate_tensors.tensors

    def forward(ubatch: UBatchSlice) -> Callable[[], Any]:
        sliced = slice_tensors(tensors, ubatch)
        received = None if sliced is None else IntermediateTensors(sliced)
        rows = ubatch.token_slice
        return lambda: model(buffers.input_ids.gpu[rows], buffers.positions.gpu[rows], received)

    metadata = [None if common is None else attn_backend.build(slice_attn_metadata(common, ubatch))
                for ubatch in ubatch_slices]
    outputs = run_ubatches([forward(ubatch) for ubatch in ubatch_slices], metadata,
                           [ubatch.num_tokens for ubatch in ubatch_slices], batch_descriptor, buffers.device)
    if isinstance(outputs[0], IntermediateTensors):
        return IntermediateTensors({key: torch.cat([out[key] for out in outputs]) for key in outputs[0].tensors})
    return torch.cat(outputs)
