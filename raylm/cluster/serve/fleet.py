"""Many models behind one OpenAI endpoint, as Ray Serve LLM's `build_openai_app({"llm_configs": [...]})`: each model
is a deployment of its own (its replicas, autoscaling, TP / PP bundles, LoRA; app.py's build_fleet_app), and one
FleetIngress reads each request's `model` and relays the request to that model's replicas.

`model` names a base model or one of its adapters (lora_modules, dynamic_lora_loading_path, or loaded at run time):
which base serves an adapter comes from the models' own listings, asked again when a request names a model not seen
before, so that an adapter put in the folder later is found. A request naming no model goes to the first model; an
unknown one is a 404 naming the models served. `/v1/models` lists every model, `/metrics` merges one replica's
metrics per model (labelled `model_name`), `/health` is healthy when every model is.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.serve.handle import DeploymentResponseGenerator

from raylm.cluster.entrypoints.openai.api_server import v1_dependencies
from raylm.cluster.entrypoints.openai.errors import OpenAIError, error_json, error_response, install_error_handlers
from raylm.cluster.entrypoints.openai.lora_endpoints import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from raylm.cluster.entrypoints.openai.protocol import ModelCard, ModelList
from raylm.cluster.serve.asgi_relay import RelayedRequest
from raylm.cluster.serve.lora_serve import requested_model
from raylm.cluster.serve.runtime_adapters import RuntimeAdapters


@dataclass
class FleetModel:
    """One model of the fleet: its served name, its deployment (bound; a handle once in the ingress)."""

    name: str
    deployment: str
    enable_lora: bool
    server: Any


class FleetLoadLoRAAdapterRequest(LoadLoRAAdapterRequest):
    model: str | None = None  # the base model; needed only where several models serve LoRA


class FleetUnloadLoRAAdapterRequest(UnloadLoRAAdapterRequest):
    model: str | None = None


@serve.ingress()
class FleetIngress:
    def __init__(self, models: list[FleetModel], api_key: str | None, runtime_lora_updating: bool) -> None:
        """`runtime_lora_updating`: RAYLM_ALLOW_RUNTIME_LORA_UPDATING where the app was built (envs.py)."""
        self.models = {model.name: model for model in models}
        self.first = models[0].name
        self.api_key = api_key
        self.adapters: dict[str, str] = {}  # adapter -> its base model, as the models last listed them
        self.runtime = ({model.name: RuntimeAdapters(model.server, model.deployment)
                         for model in models if model.enable_lora} if runtime_lora_updating else {})

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = FastAPI(title="raylm", docs_url=None, redoc_url=None, openapi_url=None)
        install_error_handlers(app)
        v1 = APIRouter(prefix="/v1", dependencies=v1_dependencies(self.api_key))

        @app.get("/health")
        async def health() -> Response:
            try:
                await asyncio.gather(*(model.server.check_health.remote() for model in self.models.values()))
            except Exception as err:
                return error_json(error_response(str(err), HTTPStatus.SERVICE_UNAVAILABLE))
            return Response(status_code=HTTPStatus.OK)

        @app.get("/metrics")
        async def metrics() -> Response:
            texts = await asyncio.gather(*(model.server.metrics_text.remote() for model in self.models.values()))
            return Response(merge_expositions(texts), media_type=CONTENT_TYPE_LATEST)

        @v1.get("/models")
        async def list_models() -> ModelList:
            return ModelList(data=await self.model_cards())

        @v1.get("/models/{model_id:path}")
        async def retrieve_model(model_id: str) -> ModelCard:
            for card in await self.model_cards():
                if card.id == model_id:
                    return card
            raise OpenAIError(f"The model `{model_id}` does not exist", HTTPStatus.NOT_FOUND, param="model")

        if self.runtime:  # only under RAYLM_ALLOW_RUNTIME_LORA_UPDATING=1, and with a model serving LoRA
            @v1.post("/load_lora_adapter")
            async def load_lora_adapter(request: FleetLoadLoRAAdapterRequest) -> PlainTextResponse:
                await self.runtime_adapters(request.model).load(request.lora_name, request.lora_path)
                return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")

            @v1.post("/unload_lora_adapter")
            async def unload_lora_adapter(request: FleetUnloadLoRAAdapterRequest) -> PlainTextResponse:
                model = request.model or self.adapters.get(request.lora_name)
                await self.runtime_adapters(model).unload(request.lora_name)
                self.adapters.pop(request.lora_name, None)
                return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")

        app.include_router(v1)

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
        async def forward(path: str, request: Request) -> Response:
            body = await request.body()
            try:
                model, adapter = await self.route(requested_model(body))
            except OpenAIError as err:
                return error_json(err.response)
            relayed = RelayedRequest(request.method, request.url.path, request.url.query.encode(),
                                     list(request.headers.raw), body)
            server = self.models[model].server.options(stream=True, multiplexed_model_id=adapter)
            messages = server.relay.remote(relayed)
            assert isinstance(messages, DeploymentResponseGenerator)  # the handle streams (stream=True)
            start = await anext(messages)
            headers = {key.decode(): value.decode() for key, value in start["headers"]}
            return StreamingResponse(_bodies(messages), status_code=start.get("status", HTTPStatus.OK),
                                     headers=headers)

        return app

    async def route(self, model: str | None) -> tuple[str, str]:
        """(the base model that serves `model`, the adapter's name or "" for the base model itself)."""
        if model is None or model in self.models:
            return model or self.first, ""
        if model not in self.adapters:
            await self.model_cards()
        base = self.adapters.get(model)
        if base is None:
            served = [*self.models, *self.adapters]
            raise OpenAIError(f"The model `{model}` does not exist; served: {served}", HTTPStatus.NOT_FOUND,
                              param="model")
        return base, model

    async def model_cards(self) -> list[ModelCard]:
        listed = await asyncio.gather(*(model.server.model_cards.remote() for model in self.models.values()))
        cards = [card for model_cards in listed for card in model_cards]
        self.adapters = {card.id: card.parent for card in cards if card.parent is not None}
        return cards

    def runtime_adapters(self, model: str | None) -> RuntimeAdapters:
        """The run-time adapters of `model`, a base model serving LoRA (the only one, where model is None)."""
        if model is None and len(self.runtime) == 1:
            return next(iter(self.runtime.values()))
        if model in self.runtime:
            return self.runtime[model]
        raise OpenAIError(f"model: {model!r} is not a model serving LoRA adapters; name one of {list(self.runtime)}",
                          param="model")


def merge_expositions(texts: Iterable[bytes]) -> bytes:
    """Prometheus expositions of several registries as one (each metric family once, with every one's samples)."""
    families: dict[str, Metric] = {}
    for text in texts:
        for family in text_string_to_metric_families(text.decode()):
            known = families.setdefault(family.name, family)
            if known is not family:
                known.samples.extend(family.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


class _Families:
    """A collector of parsed metric families."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


async def _bodies(messages: Any) -> AsyncGenerator[bytes, None]:
    async for message in messages:
        if message.get("body"):
            yield message["body"]
