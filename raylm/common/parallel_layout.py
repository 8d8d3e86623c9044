"""Where a rank sits: the rank layout of one engine's TP x PP (x DP) world, and an engine's place among lock-step
data-parallel engines. Plain facts, shared by the runner's process groups, the executor's placement and the DP
client."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankLayout:
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1

    def __post_init__(self) -> None:
        assert min(self.tp_size, self.pp_size, self.dp_size) >= 1

    @property
    def world_size(self) -> int:
        return self.dp_size * self.pp_size * self.tp_size

    def rank(self, dp: int, pp: int, tp: int) -> int:
        assert 0 <= dp < self.dp_size and 0 <= pp < self.pp_size and 0 <= tp < self.tp_size
        return (dp * self.pp_size + pp) * self.tp_size + tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp, pp, tp) of a global rank."""
        assert 0 <= rank < self.world_size
        return rank // (self.pp_size * self.tp_size), rank // self.tp_size % self.pp_size, rank % self.tp_size

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank(d, p, t) for t in range(self.tp_size)]
                for d in range(self.dp_size) for p in range(self.pp_size)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank(d, p, t) for p in range(self.pp_size)]
                for d in range(self.dp_size) for t in range(self.tp_size)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank(d, p, t) for d in range(self.dp_size)]
                for p in range(self.pp_size) for t in range(self.tp_size)]

    def ep_groups(self) -> list[list[int]]:
        return [[self.rank(d, p, t) for d in range(self.dp_size) for t in range(self.tp_size)]
                for p in range(self.pp_size)]

    @property
    def ep_size(self) -> int:
        return self.dp_size * self.tp_size

    def output_rank(self) -> int:
        """The rank that reports a step's sampled tokens: the first TP rank of the last PP stage (of DP rank 0)."""
        return self.rank(0, self.pp_size - 1, 0)


@dataclass(frozen=True)
class DataParallelInfo:
    """Where one engine sits among the DP engines that share its torch.distributed world: `size` 1 (the default)
    for an engine alone in its world. `init_method` is the shared store (tcp://host:port, hosted by the first
    engine's process), needed when size > 1."""

    rank: int = 0
    size: int = 1
    init_method: str | None = None

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.size
        assert self.size == 1 or self.init_method is not None, "DP ranks in one world need a shared rendezvous"


NO_DATA_PARALLEL = DataParallelInfo()  # an engine alone in its world
