"""What the engine reports after every step, for metrics and the log: scheduler gauges and counters, per-step token
and latency figures. Stat loggers (Prometheus, the periodic log line) turn these into series."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from raylm.cluster.core.spec_decode import SpecDecodingStats
from raylm.common.logger import show_info
from raylm.configs import EngineConfig

logger = logging.getLogger("raylm.stats")


@dataclass(frozen=True)
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    # Counters since the engine started. Prefix-cache lookups in tokens; prompt tokens are counted whole (cached ones
    # too) when a request gets its first token, as vLLM's stats line and vllm:prompt_tokens count them.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    spec_decoding: SpecDecodingStats | None = None  # counters since start; None without speculative decoding

    @classmethod
    def total(cls, per_engine: list[SchedulerStats]) -> SchedulerStats:
        """Several data-parallel engines as one: counts summed, KV usage averaged (the engines' pools are equal)."""
        def total(name: str) -> int:
            return sum(getattr(s, name) for s in per_engine)

        spec = [s.spec_decoding for s in per_engine if s.spec_decoding is not None]
        return cls(total("num_running_reqs"), total("num_waiting_reqs"),
                   sum(s.kv_cache_usage for s in per_engine) / max(len(per_engine), 1),
                   total("prefix_cache_queries"), total("prefix_cache_hits"), total("num_prompt_tokens"),
                   total("num_generation_tokens"), total("num_preemptions"),
                   SpecDecodingStats.total(spec) if spec else None)


@dataclass(frozen=True)
class FinishedRequestStats:
    """Seconds, as vLLM splits a request's life. The frontend sees the scheduler only through outputs: queue time is
    the wait for the engine to take the request in (between steps); its wait in the scheduler's queue falls into
    prefill time, which runs to the first token. Inference time is prefill plus decode."""

    finish_reason: str  # "stop" | "length" | "abort" | "error"
    e2e_latency: float  # arrival to the last output
    num_prompt_tokens: int
    num_generation_tokens: int
    queue_time: float = 0.0
    prefill_time: float = 0.0
    decode_time: float = 0.0  # first to last token

    @property
    def inference_time(self) -> float:
        return self.prefill_time + self.decode_time


@dataclass
class IterationStats:
    """Tokens and latencies of one engine step; latencies in seconds."""

    num_prompt_tokens: int = 0  # prompts of the requests that got their first token in this step
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


class StatLogger(Protocol):
    def engine_started(self, config: EngineConfig) -> None:
        """Called once the engine is built, with its resolved config (before any record)."""

    def record(self, engine_index: int, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        """Called from the engine thread after every step, once per data-parallel engine: must be quick and
        thread-safe."""


class LoggingStatLogger:
    """vLLM's periodic line, one per engine while it is busy (or just was):
    `Engine 000: Avg prompt throughput: 512.3 tokens/s, Avg generation throughput: 95.0 tokens/s, Running: 4 reqs,
    Waiting: 0 reqs, KV cache usage: 3.1%, Prefix cache hit rate: 0.0%, Preemptions: 0`."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last: dict[int, tuple[float, SchedulerStats]] = {}
        show_info(logger)

    def engine_started(self, config: EngineConfig) -> None:
        pass  # the line shows counts only

    def due(self, engine_index: int = 0) -> bool:
        """Whether the next record of this engine would log (or start its first interval)."""
        last = self._last.get(engine_index)
        return last is None or time.monotonic() - last[0] >= self.interval_s

    def record(self, engine_index: int, scheduler_stats: SchedulerStats,
               iteration_stats: IterationStats | None = None) -> None:
        now = time.monotonic()
        last = self._last.get(engine_index)
        if last is not None and now - last[0] < self.interval_s:
            return
        self._last[engine_index] = (now, scheduler_stats)
        if last is None:
            return  # the first call starts the interval
        line = self.format(engine_index, scheduler_stats, last[1], now - last[0])
        if line is not None:
            logger.info(line)

    @staticmethod
    def format(engine_index: int, stats: SchedulerStats, last: SchedulerStats, elapsed: float) -> str | None:
        """The line for the interval from `last` to `stats`; None when the engine was idle all along."""
        prompt = stats.num_prompt_tokens - last.num_prompt_tokens
        generation = stats.num_generation_tokens - last.num_generation_tokens
        if not (prompt or generation or stats.num_running_reqs or stats.num_waiting_reqs):
            return None
        queries = stats.prefix_cache_queries - last.prefix_cache_queries
        hits = stats.prefix_cache_hits - last.prefix_cache_hits
        spec = ""
        if stats.spec_decoding is not None:
            interval = stats.spec_decoding.minus(last.spec_decoding) if last.spec_decoding else stats.spec_decoding
            spec = (f", Mean acceptance length: {interval.mean_acceptance_length:.2f}, "
                    f"Draft acceptance rate: {100 * interval.acceptance_rate:.1f}%")
        return (f"Engine {engine_index:03d}: Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {generation / elapsed:.1f} tokens/s, "
                f"Running: {stats.num_running_reqs} reqs, Waiting: {stats.num_waiting_reqs} reqs, "
                f"KV cache usage: {100 * stats.kv_cache_usage:.1f}%, "
                f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%, "
                f"Preemptions: {stats.num_preemptions - last.num_preemptions}{spec}")
