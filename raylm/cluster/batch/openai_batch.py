"""The OpenAI Batch file format (what vLLM's run_batch reads and writes): one request a line (chat, completions or
embeddings), `{custom_id, method, url, body}`, answered by the OpenAI server's own code (the router over an AsyncLLM)
with one output line each, `{id, custom_id, response: {status_code, request_id, body}, error}`. A request the server
would refuse is answered with its error (status_code and error set, no body), as the server answers it."""
from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

import pyarrow as pa
import torch
from pydantic import BaseModel, ValidationError

from raylm.cluster.engine.async_llm import AsyncLLM
from raylm.cluster.entrypoints.openai.api_server import model_router
from raylm.cluster.entrypoints.openai.errors import OpenAIError, error_from_exception, error_response
from raylm.cluster.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from raylm.cluster.entrypoints.openai.protocol_embedding import EmbeddingRequest
from raylm.cluster.entrypoints.openai.router import EmbeddingRouter, ModelRouter
from raylm.cluster.serve.app import replica_torch_threads
from raylm.configs import EngineConfig

CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"


class BatchRequestInput(BaseModel):
    custom_id: str
    method: str = "POST"
    url: str
    body: dict[str, Any]


def parse_request(line: str, line_number: int) -> BatchRequestInput:
    """A line that is not a batch request fails the whole file (as in vLLM): nothing could be answered for it."""
    try:
        return BatchRequestInput.model_validate_json(line)
    except ValidationError as err:
        raise ValueError(f"input line {line_number}: not an OpenAI batch request ({{custom_id, method, url, body}}): "
                         f"{_validation_message(err)}") from None


async def answer(router: ModelRouter, request: BatchRequestInput) -> dict[str, Any]:
    """The output line of one request."""
    try:
        if request.method.upper() != "POST":
            raise OpenAIError(f"method: {request.method!r}; the batch endpoints take POST", param="method")
        body: ChatCompletionRequest | CompletionRequest
        if request.url == EMBEDDINGS_URL and isinstance(router, EmbeddingRouter):
            embeddings = await router.embeddings(EmbeddingRequest.model_validate(request.body))
            return _output(request.custom_id, HTTPStatus.OK, embeddings.model_dump(mode="json"), None)
        if request.url == CHAT_URL:
            body = ChatCompletionRequest.model_validate(request.body)
        elif request.url == COMPLETIONS_URL:
            body = CompletionRequest.model_validate(request.body)
        else:
            raise OpenAIError(f"url: {request.url!r} is not answered here; supported: {CHAT_URL}, {COMPLETIONS_URL}, "
                              f"{EMBEDDINGS_URL}", HTTPStatus.NOT_FOUND, param="url")
        if body.stream:
            raise OpenAIError("stream: a batch answers with whole responses; leave stream unset or false",
                              param="stream")
        response = await (router.chat(body) if isinstance(body, ChatCompletionRequest) else router.completions(body))
        assert isinstance(response, BaseModel)  # not streamed
        return _output(request.custom_id, HTTPStatus.OK, response.model_dump(mode="json"), None)
    except ValidationError as err:  # what the server answers a malformed body with (errors.install_error_handlers)
        location = err.errors()[0]["loc"]
        error = error_response(_validation_message(err), HTTPStatus.BAD_REQUEST, str(location[0]) if location else None)
    except Exception as err:
        error = error_from_exception(err)
    return _output(request.custom_id, error.error.code, None, error.model_dump(mode="json"))


def _output(custom_id: str, status_code: int, body: dict[str, Any] | None,
            error: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": f"raylm-{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": int(status_code), "request_id": f"raylm-batch-{uuid.uuid4().hex}",
                         "body": body},
            "error": error}


def _validation_message(err: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(part) for part in problem['loc']) or 'body'}: "
                     f"{problem['msg'].removeprefix('Value error, ')}" for problem in err.errors())


class OpenAIBatchUDF:
    """A replica of `raylm run-batch --concurrency N`: rows {line_number, request} in, {line_number, output} out, every
    request of the batches it holds in its engine at once (as the processor's EngineStageUDF)."""

    def __init__(self, engine_config: EngineConfig) -> None:
        torch.set_num_threads(replica_torch_threads())
        self.engine = AsyncLLM(engine_config)
        self.router = model_router(self.engine)

    async def __call__(self, batch: pa.Table) -> AsyncIterator[pa.Table]:
        await self.engine.wait_until_ready()
        rows = batch.to_pylist()
        outputs = await asyncio.gather(*[answer(self.router, parse_request(row["request"], row["line_number"]))
                                         for row in rows])
        yield pa.table({"line_number": [row["line_number"] for row in rows],
                        "output": [json.dumps(output) for output in outputs]})

    def __del__(self) -> None:
        if hasattr(self, "engine"):
            self.engine.shutdown()
