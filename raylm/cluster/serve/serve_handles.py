"""The OpenAI routes over Ray Serve deployment handles: what an ingress (raylm's OpenAI ingress, the PD proxy) calls on
LLMServer replicas, and the ModelRouter it serves the routes with.

A replica answers `openai_stream(kind, request)` with one item per message: ("response", the whole response),
("chunk", an SSE event) or ("error", an OpenAI error body), so errors keep their status through the handle and a
stream is relayed event by event; `embed(request)` answers /v1/embeddings with the response or the error body.
`prefill(kind, request)` runs the request as a disaggregated prefill (one token, its KV kept for a decode engine) and
returns its kv_transfer_params.
"""
from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from http import HTTPStatus
from typing import Any

from pydantic import BaseModel

from raylm.cluster.entrypoints.openai.errors import OpenAIError, error_from_exception
from raylm.cluster.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse, ModelCard
from raylm.cluster.entrypoints.openai.protocol_embedding import EmbeddingRequest, EmbeddingResponse
from raylm.cluster.entrypoints.openai.router import EmbeddingRouter, EngineModelRouter, ServingResult

logger = logging.getLogger(__name__)
OpenAIRequest = CompletionRequest | ChatCompletionRequest


class LLMServerHandles:
    """LLMServer's methods for handle callers; the replica's `engine` serves them."""

    engine: Any
    metrics: Any
    router: EngineModelRouter  # the replica's own: with enable_lora, its adapters are models too

    async def openai_stream(self, kind: str, request: OpenAIRequest) -> AsyncGenerator[tuple[str, Any], None]:
        try:
            result = await self._serve(kind, request)
        except Exception as err:
            yield "error", error_from_exception(err)
            return
        if isinstance(result, BaseModel):
            yield "response", result
            return
        async for chunk in result:
            yield "chunk", chunk

    async def prefill(self, kind: str, request: OpenAIRequest) -> dict[str, Any] | None:
        """The prompt's KV computed here for a decode engine (kv_producer): its kv_transfer_params. None for a
        request the decode side will refuse anyway (its own max_tokens is checked before it becomes 1 here)."""
        max_tokens = request.max_tokens
        if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
            max_tokens = request.max_completion_tokens
        try:
            request.sampling_params(max_tokens, None)
        except ValueError:
            return None
        update: dict[str, Any] = {"max_tokens": 1, "min_tokens": None, "n": 1, "stream": False,
                                  "stream_options": None, "logprobs": None,
                                  "kv_transfer_params": {"do_remote_decode": True}}
        if kind == "chat":
            update |= {"max_completion_tokens": None, "top_logprobs": None}
        response = await self._serve(kind, request.model_copy(update=update))
        assert isinstance(response, BaseModel)
        return getattr(response, "kv_transfer_params", None)

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResponse | ErrorResponse:
        """/v1/embeddings on this replica: the response, or the error body (its status kept through the handle)."""
        try:
            if not isinstance(self.router, EmbeddingRouter):
                raise OpenAIError("/v1/embeddings is not served by this app's models", HTTPStatus.NOT_FOUND)
            return await self.router.embeddings(request)
        except Exception as err:
            return error_from_exception(err)

    async def model_cards(self) -> list[ModelCard]:
        return await self.router.list_models()

    async def metrics_text(self) -> bytes:
        return self.metrics.exposition()

    def record_routing_stats(self) -> dict[str, Any]:
        stats = self.engine.scheduler_stats
        return {"num_running_reqs": stats.num_running_reqs, "num_waiting_reqs": stats.num_waiting_reqs,
                "kv_cache_usage": stats.kv_cache_usage}

    async def _serve(self, kind: str, request: OpenAIRequest) -> ServingResult:
        if kind == "chat":
            assert isinstance(request, ChatCompletionRequest)
            return await self.router.chat(request)
        assert kind == "completions" and isinstance(request, CompletionRequest)
        return await self.router.completions(request)


class HandleModelRouter:
    """The ModelRouter of an ingress: requests to an LLMServer deployment through its handle, after a prefill
    deployment's prefill when there is one (the PD proxy)."""

    def __init__(self, llm_server: Any, prefill_server: Any = None) -> None:
        self.llm_server = llm_server
        self.prefill_server = prefill_server

    async def list_models(self) -> list[ModelCard]:
        return await self.llm_server.model_cards.remote()

    async def completions(self, request: CompletionRequest) -> ServingResult:
        # Several prompts in one request would need a prefill each: those are served by the decode side alone.
        single = isinstance(request.prompt, str) or not request.prompt or isinstance(request.prompt[0], int)
        return await self._serve("completions", request, single)

    async def chat(self, request: ChatCompletionRequest) -> ServingResult:
        return await self._serve("chat", request, True)

    async def embeddings(self, request: EmbeddingRequest) -> EmbeddingResponse:
        response = await self.llm_server.embed.remote(request)
        if isinstance(response, ErrorResponse):
            raise OpenAIError(response.error.message, HTTPStatus(response.error.code), response.error.param)
        return response

    async def check_health(self) -> None:
        await self.llm_server.check_health.remote()
        if self.prefill_server is not None:
            await self.prefill_server.check_health.remote()

    async def metrics_text(self) -> bytes:
        return await self.llm_server.metrics_text.remote()

    async def _serve(self, kind: str, request: OpenAIRequest, single_prompt: bool) -> ServingResult:
        if (self.prefill_server is not None and single_prompt and (request.n or 1) == 1
                and request.kv_transfer_params is None):
            try:
                params = await self.prefill_server.prefill.remote(kind, request)
            except Exception:  # the decode side computes the prompt itself (and reports a bad request as such)
                logger.warning("the prefill deployment failed a request; it is decoded without its KV", exc_info=True)
                params = None
            if params is not None:
                request = request.model_copy(update={"kv_transfer_params": params})
        stream = self.llm_server.options(stream=True).openai_stream.remote(kind, request)
        first_kind, first = await stream.__anext__()
        if first_kind == "error":
            assert isinstance(first, ErrorResponse)
            stream.cancel()
            error = first.error
            raise OpenAIError(error.message, HTTPStatus(error.code), error.param)
        if first_kind == "response":
            return first

        async def relay() -> AsyncGenerator[str, None]:
            try:
                yield first
                async for _, chunk in stream:
                    yield chunk
            finally:  # the client went away: the replica's generator is cancelled, which aborts the request
                stream.cancel()

        return relay()
