"""LoRA under Ray Serve: model multiplexing, as Ray Serve LLM does it.

With enable_lora the app gets an ingress deployment (LoRAIngress) in front of the LLMServer replicas. It reads each
request's `model` and hands the request to a replica through a handle whose multiplexed_model_id is the adapter's
name (empty for the base model), so that Serve's router picks a replica that already holds the adapter, else one with
the fewest, which then loads it from dynamic_lora_loading_path (ReplicaAdapters: `serve.multiplexed` with
max_num_models_per_replica = max_loras, least recently used unloaded). The replica answers with the same FastAPI app
it serves directly (raylm/cluster/serve/asgi_relay.py), streaming included. Responses name the replica that answered in
the x-raylm-replica header.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.types import ASGIApp, Message

from raylm.cluster.entrypoints.openai.errors import OpenAIError, error_from_exception
from raylm.cluster.entrypoints.openai.serving_models import OpenAIServingModels
from raylm.cluster.serve.asgi_relay import RelayedRequest, relay

REPLICA_HEADER = "x-raylm-replica"


class LoadedAdapter:
    """What serve.multiplexed keeps per adapter on a replica. Serve calls __del__ when it unloads the least recently
    used one (in a thread): the adapter then leaves the engine, on the replica's event loop, without waiting there."""

    def __init__(self, models: OpenAIServingModels, name: str) -> None:
        self.models, self.name = models, name
        self.loop = asyncio.get_running_loop()
        self.loaded = True

    def __del__(self) -> None:
        if not self.loaded or self.loop.is_closed():
            return
        self.loaded = False
        asyncio.run_coroutine_threadsafe(self._unload(), self.loop)

    async def _unload(self) -> None:
        try:
            await self.models.unload_lora_adapter(self.name)
        except OpenAIError:
            pass  # unloaded already (or never registered)


class ReplicaAdapters:
    """A replica's side of multiplexing: the adapter a relayed request names is loaded before the request runs."""

    def __init__(self, models: OpenAIServingModels, max_loras: int, replica_id: str) -> None:
        self.models, self.replica_id = models, replica_id

        async def load(model_id: str) -> Any:
            await models.resolve(model_id)  # loads it from dynamic_lora_loading_path unless loaded
            return LoadedAdapter(models, model_id)

        self.load_adapter = serve.multiplexed(max_num_models_per_replica=max_loras)(load)

    async def relay(self, app: ASGIApp, request: RelayedRequest) -> AsyncGenerator[Message, None]:
        extra = [(REPLICA_HEADER.encode(), self.replica_id.encode())]
        model_id = serve.get_multiplexed_model_id()
        if model_id:
            try:
                await self.load_adapter(model_id)
            except OpenAIError as err:  # an unknown or unusable adapter: the client's 4xx
                body = error_from_exception(err).model_dump_json().encode()
                yield {"type": "http.response.start", "status": err.response.error.code,
                       "headers": [(b"content-type", b"application/json"), *extra]}
                yield {"type": "http.response.body", "body": body, "more_body": False}
                return
        async for message in relay(app, request, extra):
            yield message


@serve.ingress()
class LoRAIngress:
    """The app's HTTP entry with LoRA on: one route for everything, handed to a replica chosen by adapter."""

    def __init__(self, server: DeploymentHandle, base_model_name: str) -> None:
        self.server = server.options(stream=True)
        self.base_model_name = base_model_name

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = FastAPI(title="raylm", docs_url=None, redoc_url=None, openapi_url=None)

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
        async def forward(path: str, request: Request) -> Response:
            body = await request.body()
            model = requested_model(body)
            adapter = model if model and model != self.base_model_name else ""
            relayed = RelayedRequest(request.method, request.url.path, request.url.query.encode(),
                                     list(request.headers.raw), body)
            messages = self.server.options(multiplexed_model_id=adapter).relay.remote(relayed)
            assert isinstance(messages, DeploymentResponseGenerator)  # the handle streams (stream=True)
            start = await anext(messages)
            headers = {key.decode(): value.decode() for key, value in start["headers"]}
            return StreamingResponse(_bodies(messages), status_code=start.get("status", HTTPStatus.OK),
                                     headers=headers)

        return app


def requested_model(body: bytes) -> str | None:
    """The `model` field of a JSON request body, if there is one."""
    try:
        payload = json.loads(body) if body else None
    except ValueError:
        return None
    model = payload.get("model") if isinstance(payload, dict) else None
    return model if isinstance(model, str) else None


async def _bodies(messages: Any) -> AsyncGenerator[bytes, None]:
    async for message in messages:
        if message.get("body"):
            yield message["body"]
