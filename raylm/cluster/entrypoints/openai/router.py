"""Where the HTTP routes send a request: to the model it names. The app is the same in every launch mode;
only the router differs: one engine in this process here, Ray Serve deployment handles in cluster/serve/app.py."""
from __future__ import annotations

from collections.abc import AsyncGenerator
from http import HTTPStatus
from typing import Protocol, TypeAlias, runtime_checkable

from pydantic import BaseModel

from raylm.cluster.engine.async_llm import AsyncLLM
from raylm.cluster.entrypoints.openai.errors import OpenAIError
from raylm.cluster.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard
from raylm.cluster.entrypoints.openai.protocol_embedding import EmbeddingRequest, EmbeddingResponse
from raylm.cluster.entrypoints.openai.serving_chat import OpenAIServingChat
from raylm.cluster.entrypoints.openai.serving_completion import OpenAIServingCompletion
from raylm.cluster.entrypoints.openai.serving_embedding import OpenAIServingEmbedding

# A whole response, or the SSE events of a stream.
ServingResult: TypeAlias = "BaseModel | AsyncGenerator[str, None]"


class ModelRouter(Protocol):
    async def list_models(self) -> list[ModelCard]: ...

    async def completions(self, request: CompletionRequest) -> ServingResult: ...

    async def chat(self, request: ChatCompletionRequest) -> ServingResult: ...

    async def check_health(self) -> None: ...


@runtime_checkable
class EmbeddingRouter(Protocol):
    """A router that also answers /v1/embeddings (one whose models can pool); the others answer it 404."""

    async def embeddings(self, request: EmbeddingRequest) -> EmbeddingResponse: ...


def route_model(requested: str | None, model_ids: list[str]) -> str:
    """The model a request names; a missing name means the only model served."""
    if requested is None:
        if len(model_ids) == 1:
            return model_ids[0]
        raise OpenAIError(f"model: required when serving several models ({model_ids})", param="model")
    if requested not in model_ids:
        raise OpenAIError(f"The model `{requested}` does not exist; served: {model_ids}", HTTPStatus.NOT_FOUND,
                          param="model")
    return requested


class EngineModelRouter:
    """One AsyncLLM in this process."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = engine
        self.serving_completion = OpenAIServingCompletion(engine)
        self.serving_chat = OpenAIServingChat(engine)
        self.serving_embedding = OpenAIServingEmbedding(engine)

    async def model_card(self) -> ModelCard:
        await self.engine.wait_until_ready()
        config = self.engine.engine_config
        return ModelCard(id=self.engine.model_name, root=config.model_info.path,
                         max_model_len=config.model_config.max_model_len)

    async def list_models(self) -> list[ModelCard]:
        return [await self.model_card()]

    async def completions(self, request: CompletionRequest) -> ServingResult:
        route_model(request.model, [self.engine.model_name])
        return await self.serving_completion.create_completion(request)

    async def chat(self, request: ChatCompletionRequest) -> ServingResult:
        route_model(request.model, [self.engine.model_name])
        return await self.serving_chat.create_chat_completion(request)

    async def embeddings(self, request: EmbeddingRequest) -> EmbeddingResponse:
        route_model(request.model, [self.engine.model_name])
        return await self.serving_embedding.create_embedding(request)

    async def check_health(self) -> None:
        await self.engine.check_health()
