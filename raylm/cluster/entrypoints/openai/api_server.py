"""The OpenAI-compatible FastAPI app, and `raylm serve --no-ray`: that app and one engine under uvicorn."""
from __future__ import annotations

import asyncio
import secrets
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from http import HTTPStatus
from typing import Any, TypeVar

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from raylm.cluster.engine.async_llm import AsyncLLM
from raylm.cluster.engine.outputs import EngineDeadError
from raylm.cluster.entrypoints.openai.dev_endpoints import include_dev_endpoints
from raylm.cluster.entrypoints.openai.errors import OpenAIError, error_json, error_response, install_error_handlers
from raylm.cluster.entrypoints.openai.lora_endpoints import include_lora_endpoints
from raylm.cluster.entrypoints.openai.lora_router import LoRAModelRouter
from raylm.cluster.entrypoints.openai.metrics import PrometheusStatLogger
from raylm.cluster.entrypoints.openai.openapi import install_openapi
from raylm.cluster.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from raylm.cluster.entrypoints.openai.protocol_embedding import EmbeddingRequest
from raylm.cluster.entrypoints.openai.router import EmbeddingRouter, EngineModelRouter, ModelRouter, ServingResult
from raylm.cluster.models.default_model import served_model_name
from raylm.configs import EngineConfig

T = TypeVar("T")
Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]

# nginx's "client closed request": the status is never seen, the client is gone.
_CLIENT_CLOSED_REQUEST = 499


def build_app(router: ModelRouter, api_key: str | None = None, metrics: PrometheusStatLogger | None = None,
              lifespan: Lifespan | None = None) -> FastAPI:
    app = FastAPI(title="raylm", docs_url=None, redoc_url=None, lifespan=lifespan)
    install_error_handlers(app)
    v1 = APIRouter(prefix="/v1", dependencies=v1_dependencies(api_key))

    @app.get("/health")
    async def health() -> Response:
        try:
            await router.check_health()
        except Exception as err:
            return error_json(error_response(str(err), HTTPStatus.SERVICE_UNAVAILABLE))
        return Response(status_code=HTTPStatus.OK)

    if metrics is not None:
        @app.get("/metrics")
        async def prometheus_metrics() -> Response:
            return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @v1.get("/models")
    async def list_models() -> ModelList:
        return ModelList(data=await router.list_models())

    @v1.get("/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> ModelCard:
        for card in await router.list_models():
            if card.id == model_id:
                return card
        raise OpenAIError(f"The model `{model_id}` does not exist", HTTPStatus.NOT_FOUND, param="model")

    @v1.post("/completions")
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        return await _respond(router.completions(request), raw_request)

    @v1.post("/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await _respond(router.chat(request), raw_request)

    @v1.post("/embeddings")
    async def embeddings(request: EmbeddingRequest, raw_request: Request) -> Response:
        if not isinstance(router, EmbeddingRouter):
            raise OpenAIError("/v1/embeddings is not served by this app's models", HTTPStatus.NOT_FOUND)
        return await _respond(router.embeddings(request), raw_request)

    app.include_router(v1)
    install_openapi(app, api_key=bool(api_key))
    return app


def build_engine_app(config: EngineConfig) -> tuple[FastAPI, AsyncLLM]:
    """The app over one engine in this process; the engine loads in the background (/health says when)."""
    metrics = PrometheusStatLogger(served_model_name(config.model_config))
    engine = AsyncLLM(config, stat_loggers=[metrics], usage_context="openai_api_server")

    @asynccontextmanager
    async def stop_engine_on_exit(_: FastAPI) -> AsyncIterator[None]:
        yield
        engine.shutdown()

    router = model_router(engine)
    app = build_app(router, config.serving_config.api_key, metrics, stop_engine_on_exit)
    include_dev_endpoints(app, engine)  # only under RAYLM_SERVER_DEV_MODE=1
    if isinstance(router, LoRAModelRouter):  # only under RAYLM_ALLOW_RUNTIME_LORA_UPDATING=1
        include_lora_endpoints(app, router.models, v1_dependencies(config.serving_config.api_key))
    return app, engine


def run_server(config: EngineConfig) -> int:
    """Serves until Ctrl-C or SIGTERM. uvicorn then shuts the app and its engine down and re-raises the
    signal, so that the process ends as killed by it; a model that fails to load returns 1."""
    app, engine = build_engine_app(config)
    host, port = config.serving_config.host, config.serving_config.port
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    failed = False

    async def announce_when_ready() -> None:
        nonlocal failed
        try:
            await engine.wait_until_ready()
        except EngineDeadError as err:
            print(f"raylm: error: {err}", file=sys.stderr)
            failed = server.should_exit = True
            return
        print(f"raylm: serving {engine.model_name} at http://{host}:{port}/v1", flush=True)

    async def main() -> None:
        announcer = asyncio.create_task(announce_when_ready())
        try:
            await server.serve()
        finally:
            announcer.cancel()

    asyncio.run(main())
    return 1 if failed else 0


def v1_dependencies(api_key: str | None) -> list[Any]:
    return [Depends(_require_api_key(api_key))] if api_key else []


def model_router(engine: AsyncLLM) -> EngineModelRouter:
    """The router of an engine in this process: its adapters are models too when LoRA is enabled."""
    return LoRAModelRouter(engine) if engine.config.lora_config.enable_lora else EngineModelRouter(engine)


async def _respond(result: Awaitable[ServingResult], raw_request: Request) -> Response:
    response = await _cancel_on_disconnect(result, raw_request)
    if response is None:
        return Response(status_code=_CLIENT_CLOSED_REQUEST)
    if isinstance(response, BaseModel):
        return JSONResponse(response.model_dump(mode="json"))
    # Starlette cancels the body iterator when the client disconnects, which aborts the requests behind it.
    return StreamingResponse(response, media_type="text/event-stream")


async def _cancel_on_disconnect(work: Awaitable[T], raw_request: Request) -> T | None:
    """Runs `work` until done, or until the client disconnects: then cancels it (aborting its requests)
    and returns None."""
    work_task = asyncio.ensure_future(work)
    disconnect_task = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        await asyncio.wait({work_task, disconnect_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect_task.cancel()
        if not work_task.done():
            work_task.cancel()
            await asyncio.gather(work_task, return_exceptions=True)
    return None if work_task.cancelled() else work_task.result()


async def _wait_for_disconnect(raw_request: Request) -> None:
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


def _require_api_key(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    expected = f"Bearer {api_key}".encode()

    async def check(request: Request) -> None:
        if not secrets.compare_digest(request.headers.get("authorization", "").encode(), expected):
            raise OpenAIError("a valid API key is required: send `Authorization: Bearer <key>`",
                              HTTPStatus.UNAUTHORIZED)

    return check
