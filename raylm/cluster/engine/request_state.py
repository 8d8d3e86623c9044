"""What AsyncLLM's engine thread keeps of each request: where its outputs go, and the timings its metrics need."""
from __future__ import annotations

from dataclasses import dataclass

from raylm.cluster.engine.engine_commands import RequestStream
from raylm.cluster.engine.stats import FinishedRequestStats


@dataclass
class RequestState:
    """Engine-thread bookkeeping of one request: where its outputs go, and its timings for metrics."""

    stream: RequestStream
    arrival_time: float
    num_prompt_tokens: int
    engine_index: int  # the data-parallel engine serving it
    added_time: float  # when the engine took it in
    first_token_time: float | None = None
    last_token_time: float = 0.0
    num_generation_tokens: int = 0


def finished_stats(state: RequestState, finish_reason: str, now: float) -> FinishedRequestStats:
    first_token_time = now if state.first_token_time is None else state.first_token_time
    return FinishedRequestStats(
        finish_reason, now - state.arrival_time, state.num_prompt_tokens, state.num_generation_tokens,
        queue_time=state.added_time - state.arrival_time, prefill_time=first_token_time - state.added_time,
        decode_time=now - first_token_time)
