"""EngineCoreActor: one data-parallel engine (an EngineCore with its own executor and workers) as a Ray actor.

The DP client (cluster/dp/dp_client.py) creates one per DP rank in that rank's placement group, builds its engine
(`init_engine`), then `run`s its loop. Requests, aborts and calls arrive over a TCP connection from the client; each
step that produced something sends back an EngineCoreOutputs with the engine's scheduler stats. `run` lasts the
actor's working life, so the client notices a dead engine when its connection drops, and asks Ray why.

Independent engines (dense models, MoE without expert parallel) step whenever they have requests. Lock-step engines
(MoE with expert parallel) must run every forward together, since each joins the others' expert all_to_all: while
any engine has requests, an engine without any runs a dummy batch. Such a stretch is a wave. An idle engine that gets
a request starts the next wave and says so; the client passes that on, so every other engine joins. Every
WAVE_CHECK_STEPS steps all engines ask each other whether any request is left, and all go idle together when none is.
A call that frees or restores the weights (sleep, wake_up) waits for the wave to end: the other engines' dummy
forwards still need this engine's share of the collectives, on its weights.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed import TCPStore

from raylm.cluster.core.engine_core_output import EngineCoreOutput
from raylm.cluster.core.request import Request
from raylm.cluster.engine.engine_core import EngineCore
from raylm.cluster.engine.stats import SchedulerStats
from raylm.common.parallel_layout import DataParallelInfo
from raylm.configs import EngineConfig
from raylm.executor.channel import WorkerChannel
from raylm.executor.cluster_resources import process_cores

# Steps between "is any request left?" checks of lock-step engines: vLLM's figure. A wave ends at most this many
# dummy steps after its last request finishes.
WAVE_CHECK_STEPS = 32
# EngineCore calls that change the weights or the KV cache under the workers' feet: never inside a running wave.
_BETWEEN_WAVES = frozenset({"sleep", "wake_up"})


@dataclass
class EngineCoreOutputs:
    """What an engine sends its client after a step, or in answer to a call."""

    engine_index: int
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats = field(default_factory=SchedulerStats)
    num_received: int = 0  # requests this engine has taken in so far
    wave_started: int | None = None  # lock-step: this engine started that wave, the others must join it
    call_result: tuple[int, bool, Any] | None = None  # (call id, ok, value or traceback)


class EngineCoreActor:
    def __init__(self, dp_rank: int) -> None:
        self.dp_rank = dp_rank
        self.core: EngineCore | None = None
        self._store: TCPStore | None = None
        self._lockstep = False
        self._num_received = 0
        self._reported_received = 0
        # Lock-step only: the current wave's number, whether it is running, and its steps so far.
        self._wave = 0
        self._wave_running = False
        self._wave_steps = 0
        self._deferred_calls: list[tuple] = []  # lock-step: calls held back until the running wave ends

    def create_store(self, host: str) -> int:
        """DP rank 0 of lock-step engines: the torch.distributed store that all their workers join."""
        assert self.dp_rank == 0, "DP rank 0 hosts the rendezvous store"
        self._store = TCPStore(host, 0, is_master=True, multi_tenant=True, wait_for_workers=False)
        return self._store.port

    def init_engine(self, config: EngineConfig, data_parallel: DataParallelInfo, num_threads: int | None) -> int:
        """Build the engine (workers, model, KV cache); returns its KV block count."""
        if num_threads is not None:  # the engine's own worker computes in this process
            torch.set_num_threads(num_threads)
        self.core = EngineCore(config, data_parallel, engine_index=self.dp_rank)
        self._lockstep = config.resolved.dp_lockstep
        return self.core.num_blocks

    def num_cores(self) -> int:
        return process_cores()

    def run(self, address: tuple[str, int], token: str) -> None:
        """Serve the client until it sends None or closes the connection."""
        assert self.core is not None, "init_engine first"
        channel = WorkerChannel(address, self.dp_rank, token)
        try:
            while self._receive(channel, block=not self._busy()):
                outputs = self._step(channel)
                if outputs or self._num_received != self._reported_received or not self._busy():
                    self._report(channel, outputs)
        except ConnectionError:
            pass  # the client is gone: nobody is left to serve
        finally:
            channel.close()
            self.core.shutdown()

    def _busy(self) -> bool:
        assert self.core is not None
        return self.core.has_unfinished_requests() or self._wave_running

    def _receive(self, channel: WorkerChannel, block: bool) -> bool:
        """Apply every message waiting (after waiting for one if `block`); False once told to stop."""
        while channel.poll(None if block else 0):
            message = channel.recv()
            if message is None:
                return False
            self._apply(channel, message)
            block = False
        return True

    def _apply(self, channel: WorkerChannel, message: tuple) -> None:
        core = self.core
        assert core is not None
        kind = message[0]
        if kind == "add":
            requests: list[Request] = message[1]
            for request in requests:
                core.add_request(request)
            self._num_received += len(requests)
        elif kind == "abort":
            core.abort_requests(message[1])
        elif kind == "wave":
            # A wave number below ours is an echo of a wave that already ended (every engine ended it together).
            if self._lockstep and message[1] == self._wave:
                self._wave_running = True
        else:
            assert kind == "call", f"unknown message {kind!r}"
            call_id, method, args = message[1:]
            if self._wave_running and method in _BETWEEN_WAVES:
                self._deferred_calls.append(message)
                return
            try:
                result: tuple[int, bool, Any] = (call_id, True, getattr(core, method)(*args))
            except Exception:
                result = (call_id, False, traceback.format_exc())
            channel.send(EngineCoreOutputs(self.dp_rank, call_result=result))

    def _step(self, channel: WorkerChannel) -> list[EngineCoreOutput]:
        core = self.core
        assert core is not None
        if not self._lockstep:
            return core.step() if core.has_unfinished_requests() else []
        if not self._wave_running:
            if not core.has_unfinished_requests():
                return []
            # Tell the others before the first forward, which waits for them in its DP all-reduce.
            self._wave_running = True
            channel.send(EngineCoreOutputs(self.dp_rank, wave_started=self._wave))
        if core.scheduler.has_unfinished_requests():
            outputs = core.step()
        else:
            core.execute_dummy_batch()
            outputs = []
        self._wave_steps += 1
        if self._wave_steps % WAVE_CHECK_STEPS == 0 and not self._any_unfinished_across_dp():
            self._wave, self._wave_running, self._wave_steps = self._wave + 1, False, 0
            deferred, self._deferred_calls = self._deferred_calls, []
            for message in deferred:
                self._apply(channel, message)
        return outputs

    def _any_unfinished_across_dp(self) -> bool:
        core = self.core
        assert core is not None
        return core.executor.collective_rpc("has_unfinished_across_dp", (core.has_unfinished_requests(),))[0]

    def _report(self, channel: WorkerChannel, outputs: list[EngineCoreOutput]) -> None:
        assert self.core is not None
        self._reported_received = self._num_received
        channel.send(EngineCoreOutputs(self.dp_rank, outputs, self.core.engine_stats()[0], self._num_received))
