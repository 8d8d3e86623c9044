"""DPLoadBalancer: which data-parallel engine gets the next request.

vLLM's score: `4 * waiting + running`, the lowest wins (ties go to the lowest engine index). Engines report their
waiting and running counts with their outputs, which lags; requests sent since an engine's last report count as
waiting, so a burst of requests spreads out before any report comes back. The engine reports how many requests it has
received in total, so "sent since" is exact, not a guess.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _EngineLoad:
    num_waiting: int = 0
    num_running: int = 0
    num_sent: int = 0  # requests the client sent to this engine
    num_received: int = 0  # of those, the ones the engine had taken in at its last report
    alive: bool = True

    @property
    def score(self) -> int:
        return 4 * (self.num_waiting + self.num_sent - self.num_received) + self.num_running


class DPLoadBalancer:
    def __init__(self, num_engines: int) -> None:
        assert num_engines >= 1
        self.engines = [_EngineLoad() for _ in range(num_engines)]

    def choose(self, prompt_token_ids: list[int] | None = None) -> int:
        """The live engine with the lowest score; counts the request as sent to it. (The prompt is for the
        prefix-aware subclass, raylm/cluster/dp/prefix_router.py; load alone decides here.)"""
        live = [i for i, load in enumerate(self.engines) if load.alive]
        if not live:
            raise RuntimeError("no data-parallel engine is alive")
        index = min(live, key=lambda i: self.engines[i].score)
        self.engines[index].num_sent += 1
        return index

    def on_report(self, index: int, num_waiting: int, num_running: int, num_received: int) -> None:
        load = self.engines[index]
        load.num_waiting, load.num_running, load.num_received = num_waiting, num_running, num_received

    def mark_dead(self, index: int) -> None:
        self.engines[index].alive = False

    def scores(self) -> list[int]:
        return [load.score for load in self.engines]
