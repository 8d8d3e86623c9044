"""The Ray Serve application: `import_path: raylm.cluster.serve.app:build_app`, `args: {config: tiny.yaml, ...}`.

One LLMServer replica holds one engine and serves the same FastAPI app as `raylm serve --no-ray` over it
(`@serve.ingress`, as Ray Serve LLM does): HTTP goes from Serve's proxy straight to a replica, with no second
deployment hop per request or per streamed chunk. Replicas routed by prefix (routing_policy "prefix", the default
with prefix caching, and max_replicas > 1) sit behind an OpenAI ingress instead, whose handle's request router sees
the prompts (serve_ingress.py); serve_pd.py builds the disaggregated prefill/decode app. With tensor or pipeline
parallel > 1, Serve creates the replica in a placement group of the engine's bundles (the replica takes the engine's
bundle, its Ray executor's workers the rest), checked against the cluster when the app is built. Replicas autoscale
on ongoing requests. `llm_configs` builds a fleet, one deployment per model behind one ingress (fleet.py).

Serve's proxy relays every SSE event of every stream, so how it talks to the replica sets the token rate: start Serve
with `start_serve` (or a Serve config's `controller_options`) to give the proxy SERVE_ENV_VARS.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import ray
import torch
from fastapi import FastAPI
from ray import serve
from starlette.types import Message

from raylm.cluster.engine.async_llm import AsyncLLM
from raylm.cluster.engine.config_resolver import replica_deployment
from raylm.cluster.entrypoints.openai.api_server import build_app as build_fastapi_app
from raylm.cluster.entrypoints.openai.api_server import model_router
from raylm.cluster.entrypoints.openai.errors import OpenAIError
from raylm.cluster.entrypoints.openai.lora_router import LoRAModelRouter
from raylm.cluster.entrypoints.openai.metrics import PrometheusStatLogger
from raylm.cluster.entrypoints.openai.protocol import ErrorResponse, ModelCard
from raylm.cluster.models.default_model import served_model_name
from raylm.cluster.serve.asgi_relay import RelayedRequest, relay
from raylm.cluster.serve.fleet import FleetIngress, FleetModel
from raylm.cluster.serve.lora_serve import REPLICA_HEADER, ReplicaAdapters
from raylm.cluster.serve.ray_metrics import RayPrometheusStatLogger
from raylm.cluster.serve.runtime_adapters import SYNC_INTERVAL_S, adapter_table
from raylm.cluster.serve.serve_handles import LLMServerHandles
from raylm.cluster.serve.serve_ingress import OpenAIIngress, ingress_options
from raylm.cluster.serve.serve_router import prefix_router_config
from raylm.configs import EngineConfig, envs, make_engine_config
from raylm.configs.resolve import Deployment
from raylm.executor.cluster_resources import ClusterCapacity, check_fits, process_cores
from raylm.executor.placement import describe_engine

# The engine batches and queues requests itself: Serve must not hold them back from a replica.
_MAX_ONGOING_REQUESTS = 1_000_000

# Ray starts worker processes at nice 15, behind the raylet, drivers and any client on the node; a replica and the
# proxy are on the path of every token, so they run at 0 (as Ray's own job supervisor does).
REPLICA_ENV_VARS = {"RAY_worker_niceness": "0"}
# Read by Serve's controller and proxies when their processes start; the controller's runtime_env passes them on to the
# proxies it creates. gRPC: the proxy streams a replica's ASGI messages over the replica's gRPC server instead of
# Ray's object-ref streaming generator, about a third less proxy CPU per SSE event. The router on the proxy's own
# event loop saves a thread hop per event. (docs/performance.md: measured side by side with --no-ray.)
SERVE_ENV_VARS = REPLICA_ENV_VARS | {"RAY_SERVE_PROXY_USE_GRPC": "1", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


class LLMEngineServer(LLMServerHandles):
    """One replica, one engine, the OpenAI app over it. Behind an ingress it answers handle calls: the OpenAI ingress
    of replicas routed by prefix and the PD proxy (serve_handles.py), the fleet ingress (`relay`, fleet.py); as
    LLMServer it is the app's HTTP entry itself. /metrics answers from the replica that gets the request, its series
    labelled with that replica's id; the same series go to Ray's metrics from every replica."""

    async def __init__(self, config: EngineConfig) -> None:  # type: ignore[misc]  # Serve awaits an async __init__
        torch.set_num_threads(replica_torch_threads())
        context = serve.get_replica_context()
        self.replica = replica = context.replica_id.unique_id
        model_name = served_model_name(config.model_config)
        self.metrics = PrometheusStatLogger(model_name, replica)
        ray_metrics = RayPrometheusStatLogger(model_name, replica)
        self.engine = AsyncLLM(config, stat_loggers=[self.metrics, ray_metrics], usage_context="openai_api_server")
        await self.engine.wait_until_ready()
        router = self.router = model_router(self.engine)
        self.asgi_app = build_fastapi_app(router, config.serving_config.api_key, self.metrics)
        self.adapters = None
        if isinstance(router, LoRAModelRouter):
            table = adapter_table(context.app_name, context.deployment)
            self.adapters = ReplicaAdapters(router.models, config.lora_config.max_loras, replica, table)
            await self.adapters.sync()  # the adapters loaded at run time before this replica started
            self._sync_task = asyncio.create_task(self.adapters.keep_synced(SYNC_INTERVAL_S))

    async def relay(self, request: RelayedRequest) -> AsyncGenerator[Message, None]:
        """A request the fleet ingress handed to this replica (fleet.py), with the adapter it names loaded first."""
        messages = (self.adapters.relay(self.asgi_app, request) if self.adapters is not None else
                    relay(self.asgi_app, request, [(REPLICA_HEADER.encode(), self.replica.encode())]))
        async for message in messages:
            yield message

    async def model_cards(self) -> list[ModelCard]:
        """The engine's models, and the run-time adapters that multiplexing evicted from it (loaded again on use)."""
        cards = await self.router.list_models()
        if self.adapters is not None:
            listed = {card.id for card in cards}
            base = self.engine.model_name
            cards += [ModelCard(id=name, root=path, parent=base)
                      for name, path in self.adapters.runtime.items() if name not in listed]
        return cards

    async def add_adapter(self, name: str, path: str) -> ErrorResponse | None:
        """Broadcast by the fleet ingress (runtime_adapters.py): None once loaded, else the client's error."""
        assert self.adapters is not None, "adapters are loaded at run time only with enable_lora"
        try:
            await self.adapters.add(name, path)
        except OpenAIError as err:
            return err.response
        return None

    async def remove_adapter(self, name: str) -> bool:
        assert self.adapters is not None, "adapters are unloaded at run time only with enable_lora"
        return await self.adapters.remove(name)

    async def check_health(self) -> None:
        await self.engine.check_health()

    def __del__(self) -> None:
        self.engine.shutdown()


@serve.ingress()
class LLMServer(LLMEngineServer):
    """The replica as the app's HTTP entry: HTTP from Serve's proxy straight to it."""

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self.asgi_app


def start_serve(host: str, port: int) -> None:
    """serve.start with raylm's settings for Serve's own actors. Like any serve.start, it changes nothing where Serve
    already runs on the cluster (Serve warns)."""
    serve.start(http_options={"host": host, "port": port},
                controller_options={"runtime_env": {"env_vars": SERVE_ENV_VARS}})


def build_app(args: dict[str, Any]) -> serve.Application:
    """`args`: "config" (a YAML of engine settings) and any engine setting on top, e.g. "model",
    "min_replicas", "max_replicas", "tensor_parallel_size"; or "llm_configs", a list of such settings (or YAML
    paths), one per model of a fleet (build_fleet_app)."""
    settings = dict(args)
    if "llm_configs" in settings:
        entries = settings.pop("llm_configs")
        if settings or not isinstance(entries, list) or not entries:
            raise ValueError(f"llm_configs: a non-empty list of engine settings (or YAML paths), alone in args; got "
                             f"llm_configs={entries!r} beside {sorted(settings)}")
        return build_fleet_app([_engine_config(entry) for entry in entries])
    return build_openai_app(make_engine_config(settings.pop("config", None), **settings))


def build_openai_app(config: EngineConfig) -> serve.Application:
    """LLMServer replicas answering HTTP themselves; or, where replicas are routed by prefix (routing_policy, more
    than one replica), behind an OpenAI ingress whose handle routes each request (serve_ingress.py); with LoRA, a
    fleet of one (fleet.py), whose ingress picks replicas by adapter."""
    if config.lora_config.enable_lora:
        return build_fleet_app([config])
    config = _with_served_name(config)
    model_id = config.model_config.served_model_name
    deployment = replica_deployment(config)
    name, options, serving = f"LLMServer:{model_id}", llm_server_options(config, deployment), config.serving_config
    if serving.max_replicas == 1 or deployment.routing_policy == "load":
        return serve.deployment(LLMServer).options(name=name, **options).bind(config)  # type: ignore[attr-defined]
    # (Ray types serve.deployment as returning a decorator, also when given the class: hence the ignores on
    # `.options`.)
    routed = serve.deployment(LLMEngineServer).options(  # type: ignore[attr-defined]
        name=name, request_router_config=prefix_router_config(config.routing_config), **options).bind(config)
    return serve.deployment(OpenAIIngress).options(  # type: ignore[attr-defined]
        **ingress_options(f"OpenAIIngress:{model_id}", serving.min_replicas, serving.max_replicas)
    ).bind(routed, serving.api_key)


def build_fleet_app(configs: list[EngineConfig]) -> serve.Application:
    """Several models behind one FleetIngress (fleet.py), each its own deployment of LLMEngineServer replicas with its
    own replicas, autoscaling, placement group and LoRA."""
    configs = [_with_served_name(config) for config in configs]
    names = [config.model_config.served_model_name for config in configs]
    if len(set(names)) < len(names):
        raise ValueError(f"llm_configs: served_model_name must differ between models; got {names}")
    api_keys = {config.serving_config.api_key for config in configs}
    if len(api_keys) > 1:
        raise ValueError("llm_configs: api_key must be the same for every model (one endpoint serves them)")
    models = []
    for config, name in zip(configs, names):
        assert name is not None, "_with_served_name names every model"
        deployment = replica_deployment(config)
        options, lora = llm_server_options(config, deployment), config.lora_config.enable_lora
        if lora and config.serving_config.max_replicas > 1 and config.routing_config.routing_policy == "prefix":
            raise ValueError("routing_policy 'prefix' over Serve replicas cannot be combined with enable_lora: the "
                             "ingress picks replicas by adapter (Serve's multiplexing); use routing_policy auto")
        if not lora and config.serving_config.max_replicas > 1 and deployment.routing_policy == "prefix":
            options["request_router_config"] = prefix_router_config(config.routing_config)
        server = serve.deployment(LLMEngineServer).options(  # type: ignore[attr-defined]
            name=f"LLMServer:{name}", **options).bind(config)
        models.append(FleetModel(name, f"LLMServer:{name}", lora, server))
    max_replicas = max(config.serving_config.max_replicas for config in configs)
    options = ingress_options("FleetIngress", 1, max_replicas) | {
        "ray_actor_options": {"num_cpus": 0, "runtime_env": _replica_runtime_env()}}
    return serve.deployment(FleetIngress).options(**options).bind(  # type: ignore[attr-defined]
        models, api_keys.pop(), envs.runtime_lora_updating())


def _engine_config(entry: dict[str, Any] | str) -> EngineConfig:
    """One model of llm_configs: its settings ("config" a YAML of them, any setting on top), or a YAML's path."""
    if isinstance(entry, str):
        return make_engine_config(entry)
    if not isinstance(entry, dict):
        raise ValueError(f"llm_configs: each entry is a dict of engine settings or a YAML path; got {entry!r}")
    settings = dict(entry)
    return make_engine_config(settings.pop("config", None), **settings)


def _with_served_name(config: EngineConfig) -> EngineConfig:
    """The config with served_model_name decided, so that every replica and the ingress agree on it."""
    model_id = served_model_name(config.model_config)
    return dataclasses.replace(config, model_config=config.model_config.model_copy(
        update={"served_model_name": model_id}))


def llm_server_options(config: EngineConfig, deployment: Deployment) -> dict[str, Any]:
    """The replica's deployment options. Its engine's config is resolved in the replica itself; the resources Serve
    gives the replica (a GPU, the placement group of its workers) follow `deployment` (replica_deployment), asked only
    when Ray is connected as the app is built (`serve run module:app` builds first: then the replica asks for no
    device, and its engine puts its worker on a GPU actor where the cluster has GPUs)."""
    serving, parallel = config.serving_config, config.parallel_config
    connected = ray.is_initialized()
    in_process_device = connected and deployment.device == "cuda" and deployment.executor_backend == "uni"
    in_process_device = in_process_device and parallel.data_parallel_size == 1
    runs_workers = deployment.executor_backend == "ray" and parallel.data_parallel_size == 1
    placement = _replica_placement(config, deployment) if connected and runs_workers else {}
    return placement | {
        "autoscaling_config": {
            "min_replicas": serving.min_replicas,
            "max_replicas": serving.max_replicas,
            "target_ongoing_requests": serving.target_ongoing_requests,
            "upscale_delay_s": serving.upscale_delay_s,
            "downscale_delay_s": serving.downscale_delay_s,
        },
        "max_ongoing_requests": _MAX_ONGOING_REQUESTS,
        "ray_actor_options": {"num_cpus": 1, "num_gpus": 1 if in_process_device else 0,
                              "runtime_env": _replica_runtime_env()},
    }


def replica_torch_threads() -> int:
    """The torch threads of a replica's process, where a CPU engine computes in the replica itself: every core the
    process may run on, as `raylm serve --no-ray` uses, unless OMP_NUM_THREADS was in the environment the process
    started with (the app's runtime_env, or the node's). Ray sets OMP_NUM_THREADS to the replica's num_cpus (1) inside
    the process otherwise, which halved a 2-core node's throughput on SmolLM2."""
    user_setting = _environment_at_start().get("OMP_NUM_THREADS")
    if user_setting:
        return max(1, int(user_setting))
    return process_cores()


def _environment_at_start() -> dict[str, str]:
    """The environment the process was started with (Linux keeps it in /proc/self/environ, untouched by later
    os.environ changes); elsewhere the runtime_env's env_vars."""
    try:
        entries = Path("/proc/self/environ").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return dict(ray.get_runtime_context().runtime_env.get("env_vars", {}))
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


def _replica_runtime_env() -> dict[str, Any]:
    """The driver's runtime_env (what Serve gives a deployment that sets none) plus REPLICA_ENV_VARS."""
    job_env = dict(ray.get_runtime_context().runtime_env) if ray.is_initialized() else {}
    return job_env | {"env_vars": {**job_env.get("env_vars", {}), **REPLICA_ENV_VARS}}


def _replica_placement(config: EngineConfig, deployment: Deployment) -> dict[str, Any]:
    """A replica whose engine runs Ray workers gets its placement group from Serve, so that Serve and the autoscaler
    start a replica only where all of it fits. A group the cluster can never hold fails here, as the app is built,
    instead of leaving replicas pending."""
    parallel, layout = config.parallel_config, deployment.bundle_layout
    check_fits(layout.bundles, parallel.placement_group_strategy, describe_engine(layout, parallel),
               ClusterCapacity.current())
    return {"placement_group_bundles": layout.bundles, "placement_group_strategy": parallel.placement_group_strategy}
