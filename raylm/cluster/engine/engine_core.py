"""EngineCore: the scheduler and the executor, one step at a time.

A step schedules, starts the forward (execute_model), then samples (sample_tokens) and feeds the
sampled tokens back to the scheduler. Requests arrive already tokenized. When the executor can
run several steps at once (pipeline stages, async scheduling), a batch queue keeps up to
`max_concurrent_batches` of them in flight.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from typing import Any

from raylm.cluster.core.engine_core_output import EngineCoreOutput
from raylm.cluster.core.kv_cache_manager import freeing_window
from raylm.cluster.core.request import Request, RequestStatus
from raylm.cluster.core.scheduler import Scheduler
from raylm.cluster.core.structured_output import StructuredOutputManager
from raylm.cluster.engine.outputs import EngineSleepingError
from raylm.cluster.engine.stats import SchedulerStats
from raylm.common import tracing
from raylm.common.outputs import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from raylm.common.parallel_layout import NO_DATA_PARALLEL, DataParallelInfo
from raylm.configs import EngineConfig
from raylm.configs.kv_cache_groups import kv_cache_groups
from raylm.executor import Executor
from raylm.runner.kv_transfer import KVConnectorFactory, KVConnectorRole
from raylm.runner.sleep_mode import SLEEP_TAGS

# A step in flight: its SchedulerOutput and the futures of execute_model and sample_tokens.
InFlightStep = tuple[SchedulerOutput, Future, Future]
# A step whose forward runs but whose sampling waits for the step before (its grammars need that step's tokens).
DeferredStep = tuple[SchedulerOutput, Future, list[str]]


class EngineCore:
    """One engine (one DP rank). It is also the EngineCoreClient of a single-engine LLMEngine: the calls below are
    what DPEngineCoreClient offers for several engines."""

    num_engines = 1

    def __init__(self, config: EngineConfig, data_parallel: DataParallelInfo = NO_DATA_PARALLEL,
                 engine_index: int = 0) -> None:
        self.config = config
        self.model_info = config.model_info
        self.engine_index = engine_index
        self.num_steps = 0  # steps dispatched: the step number of the timeline, on every rank alike
        if config.observability_config.trace_file:
            tracing.enable(f"engine {engine_index}", pid=0)
        self.executor = Executor.get_class(config)(config, data_parallel)
        try:
            self.num_blocks = self.executor.determine_num_blocks()
            self.executor.initialize_kv_cache(self.num_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        # The scheduler side of a KV connector learns what it must of the workers' sides (vLLM's handshake).
        self.kv_connector = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER)
        if self.kv_connector is not None:
            self.kv_connector.set_xfer_handshake_metadata(
                self.executor.collective_rpc("get_kv_connector_handshake_metadata"))
        self.structured_output_manager = StructuredOutputManager(config)
        # Stage 0 of a pipeline learns a request's sampled token only from the next SchedulerOutput.
        max_model_len = config.model_config.max_model_len
        assert max_model_len is not None, "resolution sets max_model_len"
        self.scheduler = Scheduler(
            config.scheduler_config, config.cache_config, max_model_len, self.num_blocks,
            config.cache_config.block_size, send_token_ids=config.parallel_config.pipeline_parallel_size > 1,
            speculative_config=config.speculative_config, kv_connector=self.kv_connector,
            max_loras=config.lora_config.max_loras if config.lora_config.enable_lora else None,
            structured_output_manager=self.structured_output_manager,
            sliding_window=freeing_window([config.model_info.hf_config, *(
                [] if (draft := config.resolved.draft_model_info) is None else [draft.hf_config])]),
            kv_cache_groups=kv_cache_groups(config, self.num_blocks))
        self.num_generation_tokens = 0  # since start, for stats
        depth = config.resolved.max_concurrent_batches
        self.sleeping_tags: set[str] = set()  # what sleep freed and wake_up has not restored yet
        self.batch_queue: deque[InFlightStep] | None = deque(maxlen=depth) if depth > 1 else None
        self.deferred_step: DeferredStep | None = None

    def add_request(self, request: Request) -> int:
        """Queue a request (seeded: LLMEngine draws the seeds); returns the index of the engine that serves it (always
        0 here)."""
        assert request.sampling_params.seed is not None, "every rank must sample a request identically"
        if self.sleeping_tags:
            raise EngineSleepingError(f"request {request.request_id}: the engine is sleeping (its "
                                      f"{' and '.join(sorted(self.sleeping_tags))} are freed): call wake_up() first")
        self.structured_output_manager.grammar_init(request)
        self.scheduler.add_request(request)
        return 0

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> list[EngineCoreOutput]:
        if self.batch_queue is not None:
            return self.step_with_batch_queue()
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self._schedule()
        grammar_req_ids = self.structured_output_manager.sampling_requests(scheduler_output, self.scheduler.requests)
        future = self._execute_model(scheduler_output)
        grammar_output = self._grammar_bitmask(scheduler_output, grammar_req_ids)  # while the forward runs
        with tracing.span("execute_model"):
            output = future.result()
        if output is None:
            with tracing.span("sample_tokens"):
                output = self.executor.sample_tokens(grammar_output).result()
        assert output is not None, "the output rank returned no ModelRunnerOutput"
        return self._update_from_output(scheduler_output, output)

    def step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """Schedule and dispatch a step while the queue has room and the oldest step is still running (the new one
        is planned while the others compute); otherwise wait for the oldest and feed its tokens back.

        Under async scheduling a constrained request's next step is planned before its last token is known; the
        bitmask needs that token, so the step's forward starts and its sampling waits for the step before (vLLM's
        deferred sampling), and nothing more is scheduled meanwhile. Such a request verifies no drafts: they would be
        placeholders, proposed by the runner after the engine has filled the bitmask."""
        queue = self.batch_queue
        assert queue is not None and queue.maxlen is not None
        if self.deferred_step is None and len(queue) < queue.maxlen and self.scheduler.has_unfinished_requests():
            scheduler_output = self._schedule()
            # A step with no tokens still tells the workers which requests finished, and lets KV transfers finish.
            if (scheduler_output.total_num_scheduled_tokens > 0 or scheduler_output.finished_req_ids
                    or scheduler_output.kv_connector_metadata is not None):
                with tracing.span("dispatch"):
                    grammar_req_ids = self.structured_output_manager.sampling_requests(
                        scheduler_output, self.scheduler.requests)
                    execute_future = self._execute_model(scheduler_output)
                    if self._sampled_in_flight(grammar_req_ids):
                        self.deferred_step = (scheduler_output, execute_future, grammar_req_ids)
                    else:
                        grammar_output = self._grammar_bitmask(scheduler_output, grammar_req_ids)
                        queue.append((scheduler_output, execute_future, self.executor.sample_tokens(grammar_output)))
                if self.deferred_step is None and len(queue) < queue.maxlen and not queue[0][2].done():
                    return []
        if not queue:
            return []
        scheduler_output, execute_future, sample_future = queue.popleft()
        with tracing.span("wait_for_output"):
            output: ModelRunnerOutput | None = sample_future.result()
            if output is None:
                output = execute_future.result()  # an empty step answers from execute_model
        assert output is not None, "the output rank returned no ModelRunnerOutput"
        outputs = self._update_from_output(scheduler_output, output)
        if self.deferred_step is not None and not self._sampled_in_flight(self.deferred_step[2]):
            deferred_output, deferred_future, grammar_req_ids = self.deferred_step
            self.deferred_step = None
            queue.append((deferred_output, deferred_future,
                          self.executor.sample_tokens(self._grammar_bitmask(deferred_output, grammar_req_ids))))
        return outputs

    def _sampled_in_flight(self, req_ids: list[str]) -> bool:
        """Whether a step in flight has some of these requests (its tokens are not back yet)."""
        assert self.batch_queue is not None
        return any(req_id in step[0].num_scheduled_tokens for step in self.batch_queue for req_id in req_ids)

    def _grammar_bitmask(self, scheduler_output: SchedulerOutput, req_ids: list[str]) -> GrammarOutput | None:
        if not req_ids:
            return None
        with tracing.span("grammar_bitmask", num_requests=len(req_ids)):
            return self.structured_output_manager.grammar_bitmask(self.scheduler.requests, req_ids,
                                                                  scheduler_output.scheduled_spec_decode_tokens)

    def _execute_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput | None]:
        """Every step sent to the workers goes through here, so num_steps matches the workers' own count."""
        self.num_steps += 1
        return self.executor.execute_model(scheduler_output)

    def _schedule(self) -> SchedulerOutput:
        tracing.set_step(self.num_steps)  # the number of the step if it is dispatched
        with tracing.span("schedule") as event:
            scheduler_output = self.scheduler.schedule()
            if event is not None:  # tracing is on: name the requests of the step
                event.args["request_ids"] = list(scheduler_output.num_scheduled_tokens)
                event.args["num_tokens"] = scheduler_output.total_num_scheduled_tokens
        return scheduler_output

    def _update_from_output(self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput
                            ) -> list[EngineCoreOutput]:
        with tracing.span("update_from_output"):
            outputs = self.scheduler.update_from_output(scheduler_output, output)
        self.num_generation_tokens += sum(len(tokens) for tokens in output.sampled_token_ids)
        return outputs

    def execute_dummy_batch(self) -> None:
        """An idle lock-step DP engine's forward, matching the collectives of the engines that have work."""
        with tracing.span("dummy_batch"):
            self.executor.execute_dummy_batch().result()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue) or self.deferred_step is not None

    def engine_stats(self) -> list[SchedulerStats]:
        """The scheduler's gauges, one entry per engine."""
        scheduler = self.scheduler
        return [SchedulerStats(scheduler.num_running, scheduler.num_waiting, scheduler.kv_cache_usage,
                               scheduler.prefix_cache_queries, scheduler.prefix_cache_hits, scheduler.num_prompt_tokens,
                               self.num_generation_tokens, scheduler.num_preemptions,
                               None if scheduler.drafts is None else scheduler.drafts.stats.copy())]

    def drain_trace(self) -> list[dict[str, Any]]:
        """The timeline events of this engine and its workers since the last drain; trace processes numbered
        engine_index * (world_size + 1) + (0 for the engine, 1 + rank for each worker)."""
        events = tracing.drain()
        for rank_events in self.executor.collective_rpc("drain_trace"):
            events.extend(rank_events)
        offset = self.engine_index * (self.config.parallel_config.world_size + 1)
        for event in events:
            event["pid"] += offset
        return events

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        """A Worker method on every worker; results in rank order."""
        return self.executor.collective_rpc(method, args)

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Free every worker's KV cache and offload (level 1) or drop (level 2) its weights; only while idle."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (offload the weights to CPU) or 2 (drop them), got {level}")
        if self.has_unfinished_requests():
            raise RuntimeError(f"cannot sleep: {self.scheduler.num_running + self.scheduler.num_waiting} requests "
                               "are unfinished; let them finish or abort them first")
        # The KV cache comes back zeroed: no cached prefix may point into it.
        if not self.scheduler.reset_prefix_cache():
            raise RuntimeError("cannot sleep: the prefix cache could not be reset (KV blocks are still in use)")
        self.executor.collective_rpc("sleep", (level,))
        self.sleeping_tags = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore the weights and/or the KV cache (all when `tags` is None)."""
        if tags is not None and not set(tags) <= set(SLEEP_TAGS):
            raise ValueError(f"wake_up tags must be among {list(SLEEP_TAGS)}, got {tags}")
        self.executor.collective_rpc("wake_up", (tags,))
        self.sleeping_tags -= set(tags) if tags is not None else self.sleeping_tags

    def is_sleeping(self) -> bool:
        return bool(self.sleeping_tags)

    def check_health(self) -> None:
        self.executor.check_health()

    def shutdown(self) -> None:
        self.structured_output_manager.shutdown()
        self.executor.shutdown()
