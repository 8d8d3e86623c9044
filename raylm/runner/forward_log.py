"""What each forward ran as: its graph key (padded size, CUDA-graph mode, uniform decode, micro-batched) and whether
it replayed a captured graph. The runner keeps the last few thousand, so a check (scripts/gpu_check.py) can show the
key of every step of a run and fail a step that was planned as a graph replay but ran eagerly; and counts them all,
for tests. A diagnostic: the runner holds one only with `record_forwards`, and without it records and counts nothing.
"""
from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from raylm.runner.batch_descriptor import BatchDescriptor


@dataclass(frozen=True)
class ForwardRecord:
    num_tokens: int
    num_tokens_padded: int
    uniform_decode: bool
    cudagraph_mode: str  # NONE, PIECEWISE or FULL, as the DP ranks agreed
    ubatched: bool
    should_replay: bool  # planned FULL, graphs captured, a real batch (not a dummy, not micro-batched)
    replayed: bool

    @property
    def key(self) -> str:
        """E.g. "FULL/8 replayed", "NONE/37", "FULL/8 EAGER" (a missed replay)."""
        state = " replayed" if self.replayed else " EAGER" if self.should_replay else ""
        return f"{self.cudagraph_mode}/{self.num_tokens_padded}{' ubatched' if self.ubatched else ''}{state}"


@dataclass
class ForwardCounts:
    """The runner's forwards so far (steps, dummy batches, the profile run; a replayed graph counts, a capture does
    not), those padded and those micro-batched (counted once)."""

    forwards: int = 0
    padded: int = 0
    ubatched: int = 0


class ForwardLog:
    def __init__(self, maxlen: int = 4096) -> None:
        self.records: deque[ForwardRecord] = deque(maxlen=maxlen)
        self.counts = ForwardCounts()  # since the runner was built: drain() keeps them

    def record(self, plan: BatchDescriptor, should_replay: bool, replayed: bool) -> None:
        self.counts.forwards += 1
        self.counts.padded += plan.num_tokens_padded > plan.num_tokens
        self.counts.ubatched += plan.should_ubatch
        self.records.append(ForwardRecord(plan.num_tokens, plan.num_tokens_padded, plan.uniform_decode,
                                          plan.cudagraph_mode.name, plan.should_ubatch, should_replay, replayed))

    def drain(self) -> list[dict[str, Any]]:
        """The forwards recorded since the last drain, oldest first, each with its key."""
        records = [{**asdict(r), "key": r.key} for r in self.records]
        self.records.clear()
        return records
