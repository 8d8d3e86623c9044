"""raylm: an LLM serving engine for Ray clusters.

`from raylm import LLM, SamplingParams, PoolingParams, AsyncLLM`. The names load on first use, so that a worker
process, which imports only the lower floors (`raylm.runner`, `raylm.worker`), never pulls in the serving stack.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raylm.cluster.engine.async_llm import AsyncLLM
    from raylm.cluster.engine.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput
    from raylm.cluster.entrypoints.llm import LLM
    from raylm.common.pooling_params import PoolingParams
    from raylm.common.sampling_params import SamplingParams

_EXPORTS = {
    "LLM": "raylm.cluster.entrypoints.llm",
    "AsyncLLM": "raylm.cluster.engine.async_llm",
    "SamplingParams": "raylm.common.sampling_params",
    "RequestOutput": "raylm.cluster.engine.outputs",
    "CompletionOutput": "raylm.cluster.engine.outputs",
    "PoolingParams": "raylm.common.pooling_params",
    "EmbeddingRequestOutput": "raylm.cluster.engine.outputs",
}
__all__ = ["AsyncLLM", "CompletionOutput", "EmbeddingRequestOutput", "LLM", "PoolingParams", "RequestOutput",
           "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'raylm' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
