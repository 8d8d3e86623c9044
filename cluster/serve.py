"""The Ray Serve application: `import_path: cluster.serve:build_app`, `args: {config: configs/tiny.yaml, ...}`.

One LLMServer replica holds one engine; with tensor or pipeline parallel > 1, Serve creates the replica in a
placement group of the engine's bundles (the replica takes the engine's bundle, its Ray executor's workers the rest),
checked against the cluster when the app is built. Replicas autoscale on ongoing requests. The
OpenAIIngress serves the same FastAPI app as `raylm serve --no-ray`, routing each request by model id to
its LLMServer through a streaming deployment handle.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable
from contextlib import aclosing
from http import HTTPStatus
from typing import Any

import ray
from fastapi import FastAPI
from pydantic import BaseModel
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from cluster.async_llm import AsyncLLM
from cluster.default_model import served_model_name
from cluster.openai.api_server import build_app as build_fastapi_app
from cluster.openai.errors import OpenAIError, error_from_exception
from cluster.openai.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse, ModelCard, SamplingRequest
from cluster.openai.router import EngineModelRouter, ServingResult, route_model
from cluster.openai.serving_engine import SSE_DONE, sse_error
from configs import EngineConfig, make_engine_config
from executor.cluster_resources import ClusterCapacity, check_fits
from executor.placement import describe_engine, engine_bundles, resolve_device

# The engine batches and queues requests itself: Serve must not hold them back from a replica.
_MAX_ONGOING_REQUESTS = 1_000_000


class LLMServer:
    """One replica, one engine. Each request method yields a whole response (or an ErrorResponse) as its
    only item, or the SSE events of a stream."""

    async def __init__(self, config: EngineConfig) -> None:
        self.engine = AsyncLLM(config)
        await self.engine.wait_until_ready()
        self.router = EngineModelRouter(self.engine)

    async def model_card(self) -> ModelCard:
        return await self.router.model_card()

    async def completions(self, request: CompletionRequest) -> AsyncGenerator[BaseModel | str, None]:
        async for item in _result_items(self.router.completions(request)):
            yield item

    async def chat(self, request: ChatCompletionRequest) -> AsyncGenerator[BaseModel | str, None]:
        async for item in _result_items(self.router.chat(request)):
            yield item

    async def check_health(self) -> None:
        await self.engine.check_health()

    def __del__(self) -> None:
        self.engine.shutdown()


class HandleModelRouter:
    """Routes by model id to LLMServer deployments."""

    def __init__(self, servers: dict[str, DeploymentHandle]) -> None:
        self.servers = servers
        self.streaming_servers = {model: handle.options(stream=True) for model, handle in servers.items()}

    async def list_models(self) -> list[ModelCard]:
        return list(await asyncio.gather(*[handle.model_card.remote() for handle in self.servers.values()]))

    async def completions(self, request: CompletionRequest) -> ServingResult:
        return await self._forward("completions", request)

    async def chat(self, request: ChatCompletionRequest) -> ServingResult:
        return await self._forward("chat", request)

    async def check_health(self) -> None:
        await asyncio.gather(*[handle.check_health.remote() for handle in self.servers.values()])

    async def _forward(self, method: str, request: SamplingRequest) -> ServingResult:
        model = route_model(request.model, list(self.servers))
        items: DeploymentResponseGenerator = getattr(self.streaming_servers[model], method).remote(request)
        try:
            first = await anext(items)
        except BaseException:
            items.cancel()
            raise
        if isinstance(first, ErrorResponse):
            raise OpenAIError(first.error.message, HTTPStatus(first.error.code), first.error.param)
        if isinstance(first, BaseModel):
            return first
        return _relay(first, items)


@serve.ingress()
class OpenAIIngress:
    def __init__(self, servers: dict[str, DeploymentHandle], api_key: str | None = None) -> None:
        self.router = HandleModelRouter(servers)
        self.api_key = api_key

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_fastapi_app(self.router, self.api_key)


def build_app(args: dict[str, Any]) -> serve.Application:
    """`args`: "config" (a YAML of engine settings) and any engine setting on top, e.g. "model",
    "min_replicas", "max_replicas", "tensor_parallel_size"."""
    settings = dict(args)
    return build_openai_app(make_engine_config(settings.pop("config", None), **settings))


def build_openai_app(config: EngineConfig) -> serve.Application:
    model_id = served_model_name(config.model_config)
    config.model_config.served_model_name = model_id
    server = serve.deployment(LLMServer).options(name=f"LLMServer:{model_id}", **llm_server_options(config))
    ingress = serve.deployment(OpenAIIngress).options(
        name="OpenAIIngress", max_ongoing_requests=_MAX_ONGOING_REQUESTS,
        ray_actor_options={"num_cpus": 0})  # it only relays; the engines hold the CPUs
    return ingress.bind({model_id: server.bind(config)}, config.serving_config.api_key)


def llm_server_options(config: EngineConfig) -> dict[str, Any]:
    serving = config.serving_config
    return _replica_placement(config) | {
        "autoscaling_config": {
            "min_replicas": serving.min_replicas,
            "max_replicas": serving.max_replicas,
            "target_ongoing_requests": serving.target_ongoing_requests,
            "upscale_delay_s": serving.upscale_delay_s,
            "downscale_delay_s": serving.downscale_delay_s,
        },
        "max_ongoing_requests": _MAX_ONGOING_REQUESTS,
        "ray_actor_options": {"num_cpus": 1, "num_gpus": 1 if _replica_holds_device(config) else 0},
    }


def _replica_placement(config: EngineConfig) -> dict[str, Any]:
    """A replica whose engine runs Ray workers (and no DP engines) gets its placement group from Serve, so that Serve
    and the autoscaler start a replica only where all of it fits. A group the cluster can never hold fails here, as
    the app is built, instead of leaving replicas pending. Without a Ray connection yet (`serve run module:app` builds
    first) the replica's executor reserves and checks a group of its own when it starts."""
    parallel = config.parallel_config
    runs_workers = parallel.world_size > 1 or parallel.distributed_executor_backend == "ray"
    if not ray.is_initialized() or not runs_workers or parallel.data_parallel_size > 1:
        return {}
    capacity = ClusterCapacity.current()
    layout = engine_bundles(parallel, resolve_device(config.model_config), capacity)
    check_fits(layout.bundles, parallel.placement_group_strategy, describe_engine(layout, parallel), capacity)
    return {"placement_group_bundles": layout.bundles, "placement_group_strategy": parallel.placement_group_strategy}


def _replica_holds_device(config: EngineConfig) -> bool:
    """With the in-process executor the replica runs the model itself; the Ray executor's workers (or, with data
    parallel, the engine actors and their workers) hold the devices otherwise."""
    parallel = config.parallel_config
    if parallel.world_size > 1 or parallel.distributed_executor_backend == "ray" or parallel.data_parallel_size > 1:
        return False
    if config.model_config.device != "auto":
        return config.model_config.device == "cuda"
    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1


async def _result_items(result: Awaitable[ServingResult]) -> AsyncGenerator[BaseModel | str, None]:
    try:
        response = await result
    except Exception as err:  # errors cross the handle as values, keeping their status
        yield error_from_exception(err)
        return
    if isinstance(response, BaseModel):
        yield response
        return
    async with aclosing(response):
        async for chunk in response:
            yield chunk


async def _relay(first: str, rest: DeploymentResponseGenerator) -> AsyncGenerator[str, None]:
    finished = False
    try:
        yield first
        async for chunk in rest:
            yield chunk
        finished = True
    except Exception as err:  # the replica died mid-stream
        yield sse_error(err)
        yield SSE_DONE
        finished = True
    finally:
        if not finished:
            rest.cancel()  # the client went away: the replica aborts the request
