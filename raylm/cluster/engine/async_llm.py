"""AsyncLLM: the engine behind asyncio frontends (the OpenAI app, Ray Serve replicas, batch replicas).
One background thread owns the LLMEngine: it builds it, steps it while there is work, sleeps on a condition when
there is none, and applies the frontends' commands (add, abort, health check) between steps; each request's outputs
go back to an asyncio.Queue on the caller's event loop. Over 300 lines: the frontends' calls and the thread that
serves them share the command queue and the per-request streams.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Sequence
from concurrent.futures import Future
from contextlib import aclosing
from typing import Any

from raylm.cluster.engine import engine_commands
from raylm.cluster.engine.engine_commands import (
    AbortRequest,
    AddRequest,
    CallEngine,
    EngineCommand,
    RequestStream,
    StreamItem,
    post_outputs,
)
from raylm.cluster.engine.llm_engine import LLMEngine, PromptType
from raylm.cluster.engine.lora_registry import LoRARegistry
from raylm.cluster.engine.output_processor import RequestOutputKind
from raylm.cluster.engine.outputs import (
    DPEngineDiedError,
    EngineDeadError,
    EngineNotReadyError,
    PoolingRequestOutput,
    RequestOutput,
)
from raylm.cluster.engine.request_state import RequestState, finished_stats
from raylm.cluster.engine.stats import IterationStats, LoggingStatLogger, SchedulerStats, StatLogger
from raylm.cluster.models.default_model import served_model_name
from raylm.common.lora_request import LoRARequest
from raylm.common.pooling_params import PoolingParams
from raylm.common.sampling_params import SamplingParams
from raylm.configs import EngineConfig
from raylm.configs.scheduler_defaults import UsageContext

logger = logging.getLogger(__name__)


class AsyncLLM:
    def __init__(self, config: EngineConfig, stat_loggers: Sequence[StatLogger] = (),
                 usage_context: UsageContext = "engine_context") -> None:
        self.config, self.usage_context = config, usage_context
        self.model_name: str = served_model_name(config.model_config)
        self.stat_loggers = list(stat_loggers)
        observability = config.observability_config
        if not observability.disable_log_stats:
            self.stat_loggers.append(LoggingStatLogger(observability.log_stats_interval_s))
        self.scheduler_stats = SchedulerStats()  # the latest snapshot (summed over DP engines), replaced every step
        self._engine: LLMEngine | None = None
        self._cond = threading.Condition()
        self._commands: list[EngineCommand] = []
        self._stopping = False
        self._dead_reason: str | None = None
        self._started = threading.Event()  # set once the engine is built, or failed to build
        # Engine thread only: the commands being applied, and the requests in the engine.
        self._batch: deque[EngineCommand] = deque()
        self._requests: dict[str, RequestState] = {}
        self._thread = threading.Thread(target=self._run, name="raylm-engine", daemon=True)
        self._thread.start()

    # ---- state --------------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self._ready_engine().tokenizer

    @property
    def lora_registry(self) -> LoRARegistry:
        return self._ready_engine().lora_registry

    @property
    def engine_config(self) -> EngineConfig:
        """The engine's resolved config (its model's facts in `.model_info`)."""
        return self._ready_engine().config

    async def wait_until_ready(self) -> None:
        """Returns once the model is loaded; raises EngineDeadError if it failed to load."""
        if not self._started.is_set():
            await asyncio.get_running_loop().run_in_executor(None, self._started.wait)
        self._raise_if_dead()

    async def check_health(self) -> None:
        """Raises unless the engine is up and its workers answer; the check runs between steps."""
        self._raise_if_dead()
        if not self._started.is_set():
            raise EngineNotReadyError("the engine is still loading the model")
        await self._call_engine(lambda engine: engine.engine_core.check_health(), fatal=True)

    # ---- requests -----------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0,
                       lora_request: LoRARequest | None = None,
                       output_kind: RequestOutputKind = "delta") -> AsyncGenerator[RequestOutput, None]:
        """Yields delta outputs until the request finishes; with output_kind="final" (vLLM's FINAL_ONLY) only the
        finished one, whole: a consumer that wants the result alone (a batch replica) then wakes once per request
        instead of once per token; its stats keep the time to first token but have no inter-token latencies. Bad
        input raises ValueError; stopping the iteration early (a cancelled or disconnected consumer) aborts the
        request and frees its blocks."""
        async for output in self._outputs(request_id, prompt, params, priority, lora_request, output_kind):
            assert isinstance(output, RequestOutput)
            yield output

    async def encode(self, request_id: str, prompt: PromptType, pooling_params: PoolingParams, priority: int = 0,
                     lora_request: LoRARequest | None = None) -> PoolingRequestOutput:
        """vLLM's AsyncLLM.encode, awaited whole: a pooling request (an embedding) scheduled with the generation
        requests; its one output once its prompt is computed. Bad input raises ValueError."""
        async with aclosing(self._outputs(request_id, prompt, pooling_params, priority, lora_request)) as outputs:
            output = await anext(outputs)  # its only one
        assert isinstance(output, PoolingRequestOutput)
        return output

    async def _outputs(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams,
                       priority: int, lora_request: LoRARequest | None, output_kind: RequestOutputKind = "delta",
                       ) -> AsyncGenerator[RequestOutput | PoolingRequestOutput, None]:
        stream = RequestStream(asyncio.get_running_loop())
        self._submit(AddRequest(request_id, prompt, params, priority, stream, time.monotonic(), lora_request,
                                output_kind))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """LLMEngine.add_lora on the engine thread; ValueError for an adapter the engine cannot serve."""
        return bool(await self._call_engine(lambda engine: engine.add_lora(lora_request)))

    async def remove_lora(self, lora_id: int) -> bool:
        return bool(await self._call_engine(lambda engine: engine.remove_lora(lora_id)))

    async def _call_engine(self, fn: Any, fatal: bool = False) -> Any:
        result: Future[Any] = Future()
        self._submit(CallEngine(fn, result, fatal))
        return await asyncio.wrap_future(result)

    def abort(self, request_id: str) -> None:
        """Thread-safe; an unknown or finished request id is ignored."""
        with self._cond:
            if self._dead_reason is None:
                self._commands.append(AbortRequest(request_id))
                self._cond.notify()

    def shutdown(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _submit(self, command: EngineCommand) -> None:
        with self._cond:
            self._raise_if_dead()
            self._commands.append(command)
            self._cond.notify()

    def _raise_if_dead(self) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)

    def _ready_engine(self) -> LLMEngine:
        self._raise_if_dead()
        if self._engine is None:
            raise EngineNotReadyError("the engine is still loading the model")
        return self._engine

    # ---- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._engine = LLMEngine(self.config, self.usage_context)
        except BaseException as err:
            logger.exception("the engine failed to start")
            self._fail(f"the engine failed to start: {type(err).__name__}: {err}")
            return
        finally:
            self._started.set()
        engine = self._engine
        for stat_logger in self.stat_loggers:
            stat_logger.engine_started(engine.config)
        try:
            while self._wait_for_work():
                iterations = [IterationStats() for _ in range(engine.engine_core.num_engines)]
                while self._batch:
                    self._apply(self._batch[0], iterations)
                    self._batch.popleft()  # only once applied: _fail answers a command that raised
                if engine.has_unfinished_requests():
                    self._step(engine, iterations)
                self._record(iterations)
            reason = "the engine was shut down"
        except BaseException as err:
            logger.exception("the engine failed")
            reason = f"the engine failed: {type(err).__name__}: {err}"
        self._fail(reason)
        engine.shutdown()

    def _wait_for_work(self) -> bool:
        """Moves the commands that arrived since the last step into the batch, sleeping while idle; False
        to stop."""
        assert self._engine is not None
        with self._cond:
            while not (self._commands or self._stopping or self._engine.has_unfinished_requests()):
                self._cond.wait()
            self._batch.extend(self._commands)
            self._commands = []
            return not self._stopping

    def _apply(self, command: EngineCommand, iterations: list[IterationStats]) -> None:
        engine = self._engine
        assert engine is not None
        if isinstance(command, AddRequest):
            try:
                prompt_token_ids, engine_index = engine.add_request(
                    command.request_id, command.prompt, command.params, command.priority,
                    output_kind=command.output_kind, lora_request=command.lora_request)
            except ValueError as err:  # bad input fails this request only
                post_outputs([(command.stream, err)])
                return
            self._requests[command.request_id] = RequestState(
                command.stream, command.arrival_time, len(prompt_token_ids), engine_index, time.monotonic())
        elif isinstance(command, AbortRequest):
            state = self._requests.pop(command.request_id, None)
            if state is not None:
                engine.abort_request([command.request_id])
                iterations[state.engine_index].finished_requests.append(
                    finished_stats(state, "abort", time.monotonic()))
        else:
            try:
                command.result.set_result(command.fn(engine))
            except Exception as err:
                command.result.set_exception(err)
                if command.fatal or not isinstance(err, ValueError):  # ValueError: a bad adapter, its call only
                    raise

    def _step(self, engine: LLMEngine, iterations: list[IterationStats]) -> None:
        """One engine step, its outputs delivered. A lost data-parallel engine fails its own requests only, unless
        none can serve any more."""
        try:
            outputs = engine.step()
        except DPEngineDiedError as err:
            if err.fatal:
                raise
            logger.error("%s", err)
            lost = [self._requests.pop(request_id) for request_id in err.request_ids if request_id in self._requests]
            post_outputs([(state.stream, EngineDeadError(str(err))) for state in lost])
            return
        self._dispatch(outputs, iterations)

    def _dispatch(self, outputs: list[RequestOutput | PoolingRequestOutput], iterations: list[IterationStats]) -> None:
        now = time.monotonic()
        deliveries: list[tuple[RequestStream, StreamItem]] = []
        for output in outputs:
            state = self._requests.get(output.request_id)
            if state is None:
                continue
            iteration = iterations[state.engine_index]
            num_new_tokens = (0 if isinstance(output, PoolingRequestOutput) else
                              sum(len(completion.token_ids) for completion in output.outputs))
            if state.first_token_time is None:
                # A "final" output comes at the end: its first token's time travels with it.
                first_token_time = output.first_token_time if isinstance(output, RequestOutput) else None
                state.first_token_time = now if first_token_time is None else first_token_time
                iteration.num_prompt_tokens += state.num_prompt_tokens
                iteration.time_to_first_tokens.append(state.first_token_time - state.arrival_time)
            else:
                iteration.inter_token_latencies.append(now - state.last_token_time)
            state.last_token_time = now
            state.num_generation_tokens += num_new_tokens
            iteration.num_generation_tokens += num_new_tokens
            if output.finished:
                del self._requests[output.request_id]
                reason = ("stop" if isinstance(output, PoolingRequestOutput) else
                          output.outputs[-1].finish_reason or "stop")
                iteration.finished_requests.append(finished_stats(state, reason, now))
            deliveries.append((state.stream, output))
        post_outputs(deliveries)

    def _record(self, iterations: list[IterationStats]) -> None:
        assert self._engine is not None
        engine_stats = self._engine.engine_core.engine_stats()
        self.scheduler_stats = SchedulerStats.total(engine_stats)
        for stat_logger in self.stat_loggers:
            for engine_index, (scheduler_stats, iteration) in enumerate(zip(engine_stats, iterations)):
                stat_logger.record(engine_index, scheduler_stats, iteration)

    def _fail(self, reason: str) -> None:
        """Marks the engine dead and fails every request in flight or still queued."""
        with self._cond:
            self._dead_reason = reason
            commands = [*self._batch, *self._commands]
            self._batch.clear()
            self._commands = []
        streams = [state.stream for state in self._requests.values()]
        streams += [command.stream for command in commands if isinstance(command, AddRequest)]
        self._requests.clear()
        post_outputs([(stream, EngineDeadError(reason)) for stream in streams])
        for command in commands:
            if isinstance(command, CallEngine) and not command.result.done():  # a failed call already has its error
                command.result.set_exception(EngineDeadError(reason))

    async def sleep(self, level: int = 1) -> None:  # LLMEngine.sleep on the idle engine
        engine = self._ready_engine()
        await asyncio.get_running_loop().run_in_executor(None, engine_commands.call_when_idle, self._cond, lambda: bool(
            self._commands or self._batch or engine.has_unfinished_requests()), lambda: engine.sleep(level), "sleep")

    async def wake_up(self, tags: list[str] | None = None) -> None:
        engine = self._ready_engine()
        await asyncio.get_running_loop().run_in_executor(None, engine_commands.call_when_idle, self._cond, lambda: bool(
            self._commands or self._batch), lambda: engine.wake_up(tags), "wake up")

    async def is_sleeping(self) -> bool:
        return self._ready_engine().is_sleeping()
