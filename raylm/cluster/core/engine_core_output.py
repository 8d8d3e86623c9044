"""What the engine core emits per request per step: the scheduler builds it, the output processor turns it into what
users get back (engine/outputs.py). It sits in core, as the scheduler's product, so that core imports nothing above
it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from raylm.common.outputs import LogprobsLists


@dataclass
class EngineCoreOutput:
    """The delta of one request after one step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it; with "error", why
    new_logprobs: LogprobsLists | None = None
    num_cached_tokens: int = 0
    # The whole prompt's, with the first output token: one position per prompt token after the first.
    new_prompt_logprobs: LogprobsLists | None = None
    kv_transfer_params: dict[str, Any] | None = None  # from the KV connector, when the request finishes
    pooling_output: torch.Tensor | None = None  # a pooling request's vector (CPU, float32), as it finishes
