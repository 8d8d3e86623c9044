"""What the async engine reports after every step, for metrics: scheduler gauges and per-step token and
latency figures. Stat loggers (Prometheus, Ray metrics) turn these into series."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    # Prefix-cache lookups since the previous SchedulerStats, in tokens.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @classmethod
    def total(cls, per_engine: list[SchedulerStats]) -> SchedulerStats:
        """Several data-parallel engines as one: counts summed, KV usage averaged (the engines' pools are equal)."""
        return cls(sum(s.num_running_reqs for s in per_engine), sum(s.num_waiting_reqs for s in per_engine),
                   sum(s.kv_cache_usage for s in per_engine) / max(len(per_engine), 1),
                   sum(s.prefix_cache_queries for s in per_engine), sum(s.prefix_cache_hits for s in per_engine))


@dataclass(frozen=True)
class FinishedRequestStats:
    finish_reason: str  # "stop" | "length" | "abort"
    e2e_latency: float  # seconds from arrival to the last output
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    """Tokens and latencies of one engine step; latencies in seconds."""

    num_prompt_tokens: int = 0  # prompts of the requests that got their first token in this step
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


class StatLogger(Protocol):
    def record(self, engine_index: int, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        """Called from the engine thread after every step, once per data-parallel engine: must be quick and
        thread-safe."""
