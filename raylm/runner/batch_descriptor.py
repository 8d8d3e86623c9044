"""How one forward runs: its size after padding, its CUDA-graph mode, micro-batching, and (under lock-step data
parallel) every DP rank's token count. Decided once per forward by the ModelRunner, read by the rest of the step."""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class CUDAGraphMode(IntEnum):
    """vLLM's values and order: DP ranks agree on the min, so any rank running eager makes all run eager."""

    NONE = 0
    PIECEWISE = 1
    FULL = 2


@dataclass(frozen=True)
class BatchDescriptor:
    num_tokens: int  # scheduled (or dummy) tokens
    num_tokens_padded: int  # tokens the forward runs on: num_tokens plus padding rows that are never sampled
    num_reqs: int
    uniform_decode: bool  # every request has a query of exactly uniform_decode_query_len tokens (1, or 1 + k drafts)
    cudagraph_mode: CUDAGraphMode = CUDAGraphMode.NONE
    should_ubatch: bool = False
    num_tokens_across_dp: list[int] | None = None  # padded tokens of every DP rank; None without lock-step DP
    has_lora: bool = False  # a token of the batch runs through a LoRA adapter

    def __post_init__(self) -> None:
        assert 0 < self.num_tokens <= self.num_tokens_padded, (self.num_tokens, self.num_tokens_padded)
