"""What users get back, and the errors a request can meet on its way (what the engine core emits per step is
core/engine_core_output.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


class EngineSleepingError(ValueError):
    """A request reached an engine put to sleep (LLM.sleep): a ValueError, so a server fails that request only."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (an error, or shutdown): nothing more can be served."""


class EngineNotReadyError(RuntimeError):
    """The engine is still loading the model."""


class DPEngineDiedError(RuntimeError):
    """A data-parallel engine died; `request_ids` were on it and are lost. `fatal`: no engine can serve any more."""

    def __init__(self, message: str, request_ids: list[str], fatal: bool) -> None:
        super().__init__(message)
        self.request_ids = request_ids
        self.fatal = fatal


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # "stop" | "length" | "abort" (the request was aborted: its client went away, or the engine shut down) | "error"
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # One dict per generated token: token id -> logprob (the sampled token and the top-n).
    logprobs: list[dict[int, float]] | None = None
    error: str | None = None  # with finish_reason "error": why the server failed the request (e.g. its grammar)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    # None for the first prompt token (nothing precedes it), then {token id: logprob} per prompt token: the actual
    # token and the top-n.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # What the engine's KV connector says of the finished request (a prefill's: where its KV is to be taken from).
    kv_transfer_params: dict[str, Any] | None = None
    # time.monotonic() when its first token came out of the engine (vLLM's RequestMetrics.first_token_time): a
    # "final" output is the request's only one, so its consumer cannot time the first token itself.
    first_token_time: float | None = None


@dataclass
class PoolingOutput:
    data: torch.Tensor  # the pooled vector (CPU, float32)


@dataclass
class PoolingRequestOutput:
    """A pooling request's answer (vLLM's): one vector for its prompt, given once it is finished."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What LLM.embed returns per prompt (vLLM's): `.outputs.embedding` is the vector as floats."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(output.request_id, EmbeddingOutput(output.outputs.data.tolist()), output.prompt_token_ids,
                   output.finished)
