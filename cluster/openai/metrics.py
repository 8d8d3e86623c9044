"""Engine metrics in Prometheus text format, under vLLM's names (so existing dashboards and autoscaling
queries work unchanged), each series labelled with model_name. One registry per app."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from cluster.stats import IterationStats, SchedulerStats

FINISH_REASONS = ("stop", "length", "abort")
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                    20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
_REQUEST_LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 300.0, 600.0,
                            1200.0, 2400.0, 7200.0)


class PrometheusStatLogger:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name", "engine"]  # engine: the data-parallel engine index, as vLLM labels it

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=self.registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

        self.num_requests_running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).")
        # prometheus_client appends `_total` to counter names.
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.request_success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                                       [*labels, "finished_reason"], registry=self.registry)
        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds", "Time to the first token.",
                                             _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds", "Time between output tokens.",
                                             _LATENCY_BUCKETS)
        self.e2e_request_latency = histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.",
                                             _REQUEST_LATENCY_BUCKETS)
        self._prefix_cache_totals: dict[int, tuple[int, int]] = {}
        # Every finish reason shows from the start (at 0), so rates over it are defined before the first abort.
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name=model_name, engine="0", finished_reason=reason)

    def record(self, engine_index: int, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        label = {"model_name": self.model_name, "engine": str(engine_index)}
        self.num_requests_running.labels(**label).set(scheduler_stats.num_running_reqs)
        self.num_requests_waiting.labels(**label).set(scheduler_stats.num_waiting_reqs)
        self.kv_cache_usage.labels(**label).set(scheduler_stats.kv_cache_usage)
        queries, hits = scheduler_stats.prefix_cache_queries, scheduler_stats.prefix_cache_hits
        last_queries, last_hits = self._prefix_cache_totals.get(engine_index, (0, 0))
        self.prefix_cache_queries.labels(**label).inc(queries - last_queries)
        self.prefix_cache_hits.labels(**label).inc(hits - last_hits)
        self._prefix_cache_totals[engine_index] = (queries, hits)

        self.prompt_tokens.labels(**label).inc(iteration_stats.num_prompt_tokens)
        self.generation_tokens.labels(**label).inc(iteration_stats.num_generation_tokens)
        for ttft in iteration_stats.time_to_first_tokens:
            self.time_to_first_token.labels(**label).observe(ttft)
        for latency in iteration_stats.inter_token_latencies:
            self.inter_token_latency.labels(**label).observe(latency)
        for finished in iteration_stats.finished_requests:
            self.request_success.labels(finished_reason=finished.finish_reason, **label).inc()
            self.e2e_request_latency.labels(**label).observe(finished.e2e_latency)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
