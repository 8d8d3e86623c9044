"""The OpenAI wire format of /v1/embeddings (OpenAI's fields, and vLLM's extensions add_special_tokens, normalize and
priority)."""
from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import Field

from raylm.cluster.entrypoints.openai.protocol import (
    _INTEGRAL,
    _REQUEST_CONFIG,
    JsonInt,
    NonEmptyList,
    NonEmptyStr,
    OpenAIBaseModel,
    UsageInfo,
)


class EmbeddingRequest(OpenAIBaseModel):
    model_config = _REQUEST_CONFIG
    model: str | None = None
    # A string, strings, token ids, or lists of token ids: one embedding each.
    input: NonEmptyStr | NonEmptyList[NonEmptyStr] | NonEmptyList[JsonInt] | NonEmptyList[NonEmptyList[JsonInt]]
    encoding_format: Literal["float", "base64"] = "float"  # base64: the float32 values' little-endian bytes
    dimensions: Annotated[int, Field(ge=1), _INTEGRAL] | None = None  # Matryoshka models only
    user: str | None = None
    add_special_tokens: bool = True  # the tokenizer's BOS / EOS around a text input
    normalize: bool | None = None  # None: as the model's pooler config says
    priority: JsonInt | None = None  # with scheduling_policy "priority": smaller is served first


class EmbeddingData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # a string under encoding_format "base64"


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo
