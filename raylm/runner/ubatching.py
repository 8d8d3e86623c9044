"""Dual batch overlap (DBO): the micro-batches (ubatches) of one forward run on threads of their own that hand off
to each other at the MoE all_to_alls (vLLM's UBatchContext and UBatchWrapper).

Strict ping-pong: exactly one ubatch thread runs at a time, and it gives the turn away only in `dbo_yield`, right
after starting an async collective; the other ubatch computes while that collective is in flight, then yields back.
Ubatch 0 always runs first and the yields sit at the same places of the same model in both threads, so every rank
issues the same collectives in the same order on every process group (gloo pairs the collectives of a group by
their issue order), and ubatch 0 reaches each layer's attention before ubatch 1 reads the K/V it wrote there.

On CUDA each ubatch also has streams of its own (vLLM's DBO shape): a compute stream its kernels go to, and a
communication stream its collectives are issued from. Events order them where the threads hand off: a collective
starts once its ubatch's compute has produced the inputs (`compute_done` -> comm stream), the compute that reads
the result waits for it (`comm_done` -> compute stream), and a ubatch taking its turn waits for the other's compute
up to the hand-off (K/V written by the first ubatch before the second reads it). So one ubatch's exchange overlaps
the other's kernels on the device, not only on the host. On CPU there are no streams: the threads alone overlap the
gloo exchange.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from raylm.common.outputs import IntermediateTensors
from raylm.runner.attention.backend import AttentionBackend
from raylm.runner.attention.common import CommonAttentionMetadata
from raylm.runner.batch_descriptor import BatchDescriptor
from raylm.runner.forward_context import set_forward_context
from raylm.runner.input_buffers import InputBuffers
from raylm.runner.ubatch_splitting import UBatchSlice, slice_attn_metadata, slice_tensors

T = TypeVar("T")


class Work(Protocol):
    """What an async torch.distributed collective returns."""

    def wait(self) -> Any: ...


@dataclass
class UBatchStreams:
    """One ubatch's CUDA streams and the events at its hand-off points."""

    compute: torch.cuda.Stream
    comm: torch.cuda.Stream
    compute_done: torch.cuda.Event = field(default_factory=torch.cuda.Event)  # the ubatch's compute so far
    comm_done: torch.cuda.Event = field(default_factory=torch.cuda.Event)  # its last collective

    @classmethod
    def create(cls, device: torch.device) -> UBatchStreams:
        return cls(torch.cuda.Stream(device), torch.cuda.Stream(device))


_STREAMS: dict[int, list[UBatchStreams]] = {}


def ubatch_streams(device: torch.device, num_ubatches: int) -> list[UBatchStreams]:
    """The ubatches' streams on `device`, created once per device (a fresh stream per forward would be a leak)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    streams = _STREAMS.setdefault(index, [])
    while len(streams) < num_ubatches:
        streams.append(UBatchStreams.create(torch.device("cuda", index)))
    return streams[:num_ubatches]


class UBatchContext:
    """One ubatch thread's turn-taking. `cpu_wait_event` is set when it is this thread's turn; `cpu_signal_event`
    is the next ubatch's. `streams`: the ubatch's CUDA streams (None on CPU)."""

    def __init__(self, ubatch_id: int, cpu_wait_event: threading.Event, cpu_signal_event: threading.Event,
                 streams: UBatchStreams | None = None) -> None:
        self.id = ubatch_id
        self.cpu_wait_event = cpu_wait_event
        self.cpu_signal_event = cpu_signal_event
        self.streams = streams
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
        self._record_compute_done()
        self.cpu_signal_event.set()

    def yield_(self) -> None:
        """Hand the turn to the next ubatch and wait for it to come back; alone (the other one finished), go on."""
        assert self.next is not None
        if self.next.done:
            return
        self._record_compute_done()
        self.cpu_signal_event.set()
        self._wait_turn()

    def overlap(self, launch: Callable[[], Work]) -> None:
        """Start an async collective, let the other ubatch run while it is in flight, then make this ubatch's
        compute wait for it (on CUDA: on the device only; the host goes on)."""
        streams = self.streams
        if streams is None:
            work = launch()
            self.yield_()
            work.wait()
            return
        streams.compute_done.record(streams.compute)
        streams.comm.wait_event(streams.compute_done)
        with torch.cuda.stream(streams.comm):
            work = launch()
            work.wait()  # NCCL: the comm stream waits for the collective
        streams.comm_done.record(streams.comm)
        self.yield_()
        streams.compute.wait_event(streams.comm_done)

    def _record_compute_done(self) -> None:
        if self.streams is not None:
            self.streams.compute_done.record(self.streams.compute)

    def _wait_turn(self) -> None:
        self.cpu_wait_event.wait()
        self.cpu_wait_event.clear()
        other = self.next
        if self.streams is not None and other is not None and other.streams is not None:
            # The other ubatch's kernels up to its hand-off come first (an event never recorded: nothing to wait on).
            self.streams.compute.wait_event(other.streams.compute_done)


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


def dbo_overlap(launch: Callable[[], Work]) -> None:
    """Run the async collective `launch` starts, overlapped with the other ubatch (UBatchContext.overlap); outside
    micro-batching, wait for it."""
    context = _local.context
    if context is None:
        launch().wait()
        return
    context.overlap(launch)


def run_ubatches(forwards: Sequence[Callable[[], T]], attn_metadata: Sequence[Any], num_tokens: Sequence[int],
                 batch_descriptor: BatchDescriptor | None, device: torch.device) -> list[T]:
    """forwards[i]() on thread i under its own forward context (on CUDA on its own streams), in ping-pong from
    ubatch 0; results in ubatch order. An exception in a ubatch ends its turns (the other goes on alone) and is
    raised here."""
    n = len(forwards)
    events = [threading.Event() for _ in range(n)]
    streams: list[UBatchStreams | None] = [None] * n
    if device.type == "cuda":
        streams = list(ubatch_streams(device, n))
        inputs_ready = torch.cuda.Event()
        inputs_ready.record()  # the inputs were written on the caller's stream
        for s in streams:
            assert s is not None
            s.compute.wait_event(inputs_ready)
    contexts = [UBatchContext(i, events[i], events[(i + 1) % n], streams[i]) for i in range(n)]
    for i, context in enumerate(contexts):
        context.next = contexts[(i + 1) % n]
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # the current device is per thread
            # Inference mode is per thread too; so is the current stream.
            with torch.inference_mode(), _on_stream(streams[i]), contexts[i], set_forward_context(
                    attn_metadata[i], num_tokens[i], batch_descriptor):
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
    if device.type == "cuda":
        _join_streams(streams, results)
    return results


def _on_stream(streams: UBatchStreams | None) -> AbstractContextManager[Any]:
    return nullcontext() if streams is None else torch.cuda.stream(streams.compute)


def _join_streams(streams: Sequence[UBatchStreams | None], results: Sequence[Any]) -> None:
    """The caller's stream waits for every ubatch's kernels, and the results (allocated on the ubatch streams) are
    marked as used on it, so the allocator does not hand their memory out before the caller is done with them."""
    caller = torch.cuda.current_stream()
    for s in streams:
        assert s is not None
        caller.wait_event(s.compute_done)
    for result in results:
        tensors = result.tensors.values() if hasattr(result, "tensors") else [result]
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                tensor.record_stream(caller)


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
