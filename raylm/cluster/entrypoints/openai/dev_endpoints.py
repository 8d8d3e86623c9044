"""Development routes of the OpenAI server (vLLM's, under VLLM_SERVER_DEV_MODE): sleep mode over HTTP.

Only with RAYLM_SERVER_DEV_MODE=1: they free and restore the engine's GPU memory, which no public server should let
its clients do.
"""
from __future__ import annotations

from http import HTTPStatus
from typing import Annotated

from fastapi import APIRouter, FastAPI, Query
from fastapi.responses import JSONResponse

from raylm.cluster.engine.async_llm import AsyncLLM
from raylm.cluster.entrypoints.openai.errors import error_json, error_response
from raylm.configs import envs


def include_dev_endpoints(app: FastAPI, engine: AsyncLLM) -> None:
    """Add POST /sleep?level=N, POST /wake_up[?tags=weights&tags=kv_cache] and GET /is_sleeping, when the dev flag
    is set."""
    if not envs.server_dev_mode():
        return
    router = APIRouter()

    @router.post("/sleep")
    async def sleep(level: int = 1) -> JSONResponse:
        try:
            await engine.sleep(level)
        except (ValueError, RuntimeError) as err:
            return error_json(error_response(str(err), HTTPStatus.BAD_REQUEST))
        return JSONResponse({"is_sleeping": True})

    @router.post("/wake_up")
    async def wake_up(tags: Annotated[list[str] | None, Query()] = None) -> JSONResponse:
        try:
            await engine.wake_up(tags)
        except (ValueError, RuntimeError) as err:
            return error_json(error_response(str(err), HTTPStatus.BAD_REQUEST))
        return JSONResponse({"is_sleeping": await engine.is_sleeping()})

    @router.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        return JSONResponse({"is_sleeping": await engine.is_sleeping()})

    app.include_router(router)
