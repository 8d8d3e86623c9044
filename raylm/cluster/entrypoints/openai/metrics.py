"""Engine metrics in Prometheus text format, under vLLM's names (so existing dashboards and autoscaling
queries work unchanged), each series labelled with model_name and engine (and replica, on Ray Serve, where each
replica answers /metrics from its own registry). One registry per app."""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from raylm.cluster.engine.stats import IterationStats, SchedulerStats
from raylm.configs import CacheConfig, EngineConfig

FINISH_REASONS = ("stop", "length", "abort", "error")
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                    20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
_REQUEST_LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 300.0, 600.0,
                            1200.0, 2400.0, 7200.0)
_TOKEN_COUNT_BUCKETS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5))  # vLLM's 1-2-5 series


class PrometheusStatLogger:
    def __init__(self, model_name: str, replica: str | None = None) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.cache_config: CacheConfig | None = None  # the engine's resolved one, once it has started
        self.constant_labels = {"model_name": model_name} | ({"replica": replica} if replica else {})
        labels = [*self.constant_labels, "engine"]  # engine: the data-parallel engine index, as vLLM labels it

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return self._gauge(name, doc, [*labels, *extra])

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return self._counter(name, doc, [*labels, *extra])

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return self._histogram(name, doc, labels, buckets)

        self.num_requests_running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).")
        # prometheus_client appends `_total` to counter names.
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("vllm:num_preemptions", "Requests preempted (their KV blocks freed).")
        self.request_success = counter("vllm:request_success", "Finished requests, by finish reason.",
                                       ("finished_reason",))
        self.cache_config_info = gauge("vllm:cache_config_info", "The KV cache settings, as labels.",
                                       tuple(CacheConfig.model_fields))
        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds", "Time to the first token.",
                                             _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds", "Time between output tokens.",
                                             _LATENCY_BUCKETS)
        self.e2e_request_latency = histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.",
                                             _REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = histogram("vllm:request_queue_time_seconds",
                                            "Arrival to being taken in by the engine.", _REQUEST_LATENCY_BUCKETS)
        self.request_prefill_time = histogram("vllm:request_prefill_time_seconds",
                                              "Taken in by the engine to the first token.", _REQUEST_LATENCY_BUCKETS)
        self.request_decode_time = histogram("vllm:request_decode_time_seconds", "First to last token.",
                                             _REQUEST_LATENCY_BUCKETS)
        self.request_inference_time = histogram("vllm:request_inference_time_seconds", "Prefill plus decode time.",
                                                _REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt tokens per finished request.",
                                               _TOKEN_COUNT_BUCKETS)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Generated tokens per finished request.", _TOKEN_COUNT_BUCKETS)
        self.spec_decode_num_drafts = counter("vllm:spec_decode_num_drafts",
                                              "Speculative decoding: request steps that verified drafts.")
        self.spec_decode_num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens",
                                                    "Speculative decoding: draft tokens verified.")
        self.spec_decode_num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens",
                                                       "Speculative decoding: draft tokens accepted.")
        self.spec_decode_num_accepted_tokens_per_pos = counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Speculative decoding: draft tokens accepted, by position.",
            ("position",))
        self.iteration_tokens = histogram("vllm:iteration_tokens_total", "Prompt plus generated tokens per step.",
                                          _TOKEN_COUNT_BUCKETS)
        self._last_stats: dict[int, SchedulerStats] = {}
        self._add_engine(0)

    # How each kind of metric is made: prometheus_client's, in this app's registry (RayPrometheusStatLogger: Ray's).
    def _gauge(self, name: str, doc: str, labels: list[str]) -> Any:
        return Gauge(name, doc, labels, registry=self.registry)

    def _counter(self, name: str, doc: str, labels: list[str]) -> Any:
        return Counter(name, doc, labels, registry=self.registry)

    def _histogram(self, name: str, doc: str, labels: list[str], buckets: tuple[float, ...]) -> Any:
        return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

    def engine_started(self, config: EngineConfig) -> None:
        # The labels show what runs: the attention backend as resolved, not the setting's "auto".
        self.cache_config = config.cache_config.model_copy(
            update={"attention_backend": config.resolved.attention_backend})
        for engine_index in self._last_stats:
            self._set_cache_config_info(engine_index)

    def _add_engine(self, engine_index: int) -> None:
        """Series that show from the start: every finish reason at 0 (so rates over it are defined before the
        first abort), and the cache settings."""
        self._last_stats[engine_index] = SchedulerStats()
        label = self._labels(engine_index)
        for reason in FINISH_REASONS:
            self.request_success.labels(finished_reason=reason, **label)
        self._set_cache_config_info(engine_index)

    def _set_cache_config_info(self, engine_index: int) -> None:
        if self.cache_config is not None:
            settings = {name: str(value) for name, value in self.cache_config.model_dump().items()}
            self.cache_config_info.labels(**self._labels(engine_index), **settings).set(1)

    def _labels(self, engine_index: int) -> dict[str, str]:
        return self.constant_labels | {"engine": str(engine_index)}

    def record(self, engine_index: int, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        if engine_index not in self._last_stats:
            self._add_engine(engine_index)
        label = self._labels(engine_index)
        self.num_requests_running.labels(**label).set(scheduler_stats.num_running_reqs)
        self.num_requests_waiting.labels(**label).set(scheduler_stats.num_waiting_reqs)
        self.kv_cache_usage.labels(**label).set(scheduler_stats.kv_cache_usage)
        last = self._last_stats[engine_index]
        self.prefix_cache_queries.labels(**label).inc(scheduler_stats.prefix_cache_queries - last.prefix_cache_queries)
        self.prefix_cache_hits.labels(**label).inc(scheduler_stats.prefix_cache_hits - last.prefix_cache_hits)
        self.num_preemptions.labels(**label).inc(scheduler_stats.num_preemptions - last.num_preemptions)
        self._record_spec_decoding(label, scheduler_stats, last)
        self._last_stats[engine_index] = scheduler_stats

        self.prompt_tokens.labels(**label).inc(iteration_stats.num_prompt_tokens)
        self.generation_tokens.labels(**label).inc(iteration_stats.num_generation_tokens)
        step_tokens = iteration_stats.num_prompt_tokens + iteration_stats.num_generation_tokens
        if step_tokens:  # records that only applied commands (no step) are not iterations
            self.iteration_tokens.labels(**label).observe(step_tokens)
        for ttft in iteration_stats.time_to_first_tokens:
            self.time_to_first_token.labels(**label).observe(ttft)
        for latency in iteration_stats.inter_token_latencies:
            self.inter_token_latency.labels(**label).observe(latency)
        for finished in iteration_stats.finished_requests:
            self.request_success.labels(finished_reason=finished.finish_reason, **label).inc()
            self.e2e_request_latency.labels(**label).observe(finished.e2e_latency)
            self.request_queue_time.labels(**label).observe(finished.queue_time)
            self.request_prefill_time.labels(**label).observe(finished.prefill_time)
            self.request_decode_time.labels(**label).observe(finished.decode_time)
            self.request_inference_time.labels(**label).observe(finished.inference_time)
            self.request_prompt_tokens.labels(**label).observe(finished.num_prompt_tokens)
            self.request_generation_tokens.labels(**label).observe(finished.num_generation_tokens)

    def _record_spec_decoding(self, label: dict[str, str], stats: SchedulerStats, last: SchedulerStats) -> None:
        spec = stats.spec_decoding
        if spec is None:
            return
        delta = spec.minus(last.spec_decoding) if last.spec_decoding is not None else spec
        self.spec_decode_num_drafts.labels(**label).inc(delta.num_drafts)
        self.spec_decode_num_draft_tokens.labels(**label).inc(delta.num_draft_tokens)
        self.spec_decode_num_accepted_tokens.labels(**label).inc(delta.num_accepted_tokens)
        for position, accepted in enumerate(delta.num_accepted_tokens_per_pos):
            self.spec_decode_num_accepted_tokens_per_pos.labels(position=str(position), **label).inc(accepted)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
