"""How a runner's forwards went so far, for tests and gpu_check: all of them, padded ones, micro-batched ones."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from raylm.runner.ubatching import current_ubatch_id


@dataclass
class ForwardCounts:
    forwards: int = 0
    padded: int = 0
    ubatched: int = 0


class CountForwards:
    """A forward pre-hook on the model, so a forward on any path counts (a micro-batched one once). Not a runner
    method: the model would then keep the runner alive."""

    def __init__(self, counts: ForwardCounts) -> None:
        self.counts = counts

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        if not current_ubatch_id():
            self.counts.forwards += 1
