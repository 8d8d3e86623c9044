"""Requests to a LoRA adapter: the adapter is a model, named by the request's `model`. Each adapter is served by the
same completion and chat code as the base model, over a view of the engine that runs its requests with the adapter
and names the adapter in the responses."""
from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from raylm.cluster.engine.async_llm import AsyncLLM
from raylm.cluster.engine.output_processor import RequestOutputKind
from raylm.cluster.engine.outputs import PoolingRequestOutput, RequestOutput
from raylm.cluster.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard
from raylm.cluster.entrypoints.openai.protocol_embedding import EmbeddingRequest, EmbeddingResponse
from raylm.cluster.entrypoints.openai.router import EngineModelRouter, ServingResult
from raylm.cluster.entrypoints.openai.serving_chat import OpenAIServingChat
from raylm.cluster.entrypoints.openai.serving_completion import OpenAIServingCompletion
from raylm.cluster.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from raylm.cluster.entrypoints.openai.serving_models import OpenAIServingModels
from raylm.common.lora_request import LoRARequest
from raylm.common.pooling_params import PoolingParams
from raylm.common.sampling_params import SamplingParams


class AdapterEngine:
    """What the serving classes use of an AsyncLLM, with every request run under one adapter."""

    def __init__(self, engine: AsyncLLM, lora_request: LoRARequest) -> None:
        self.engine, self.lora_request = engine, lora_request
        self.model_name = lora_request.lora_name

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def engine_config(self) -> Any:
        return self.engine.engine_config

    async def wait_until_ready(self) -> None:
        await self.engine.wait_until_ready()

    def generate(self, request_id: str, prompt: Any, params: SamplingParams, priority: int = 0,
                 output_kind: RequestOutputKind = "delta") -> AsyncGenerator[RequestOutput, None]:
        return self.engine.generate(request_id, prompt, params, priority, lora_request=self.lora_request,
                                    output_kind=output_kind)

    async def encode(self, request_id: str, prompt: Any, pooling_params: PoolingParams,
                     priority: int = 0) -> PoolingRequestOutput:
        return await self.engine.encode(request_id, prompt, pooling_params, priority, lora_request=self.lora_request)


class LoRAModelRouter(EngineModelRouter):
    """One AsyncLLM with enable_lora: the base model and its adapters."""

    def __init__(self, engine: AsyncLLM) -> None:
        super().__init__(engine)
        self.models = OpenAIServingModels(engine)

    async def list_models(self) -> list[ModelCard]:
        return await self.models.model_cards()

    async def completions(self, request: CompletionRequest) -> ServingResult:
        lora = await self.models.resolve(request.model)
        if lora is None:
            return await self.serving_completion.create_completion(request)
        return await OpenAIServingCompletion(AdapterEngine(self.engine, lora)).create_completion(request)  # type: ignore[arg-type]

    async def chat(self, request: ChatCompletionRequest) -> ServingResult:
        lora = await self.models.resolve(request.model)
        if lora is None:
            return await self.serving_chat.create_chat_completion(request)
        return await OpenAIServingChat(AdapterEngine(self.engine, lora)).create_chat_completion(request)  # type: ignore[arg-type]

    async def embeddings(self, request: EmbeddingRequest) -> EmbeddingResponse:
        lora = await self.models.resolve(request.model)
        if lora is None:
            return await self.serving_embedding.create_embedding(request)
        return await OpenAIServingEmbedding(AdapterEngine(self.engine, lora)).create_embedding(request)  # type: ignore[arg-type]
