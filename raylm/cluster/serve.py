"""The Ray Serve application: `import_path: raylm.cluster.serve:build_app`, `args: {config: tiny.yaml, ...}`.

One LLMServer replica holds one engine and serves the same FastAPI app as `raylm serve --no-ray` over it
(`@serve.ingress`, as Ray Serve LLM does): HTTP goes from Serve's proxy straight to a replica, with no second
deployment hop per request or per streamed chunk. With tensor or pipeline parallel > 1, Serve creates the replica
in a placement group of the engine's bundles (the replica takes the engine's bundle, its Ray executor's workers the
rest), checked against the cluster when the app is built. Replicas autoscale on ongoing requests.

Serve's proxy relays every SSE event of every stream, so how it talks to the replica sets the token rate: start Serve
with `start_serve` (or a Serve config's `controller_options`) to give the proxy SERVE_ENV_VARS.
"""
from __future__ import annotations

from typing import Any

import ray
from fastapi import FastAPI
from ray import serve

from raylm.cluster.async_llm import AsyncLLM
from raylm.cluster.default_model import served_model_name
from raylm.cluster.openai.api_server import build_app as build_fastapi_app
from raylm.cluster.openai.metrics import PrometheusStatLogger
from raylm.cluster.openai.router import EngineModelRouter
from raylm.cluster.ray_metrics import RayPrometheusStatLogger
from raylm.configs import EngineConfig, make_engine_config
from raylm.executor.cluster_resources import ClusterCapacity, check_fits
from raylm.executor.device import resolve_device, workers_on_ray
from raylm.executor.placement import describe_engine, engine_bundles

# The engine batches and queues requests itself: Serve must not hold them back from a replica.
_MAX_ONGOING_REQUESTS = 1_000_000

# Ray starts worker processes at nice 15, behind the raylet, drivers and any client on the node; a replica and the
# proxy are on the path of every token, so they run at 0 (as Ray's own job supervisor does).
REPLICA_ENV_VARS = {"RAY_worker_niceness": "0"}
# Read by Serve's controller and proxies when their processes start; the controller's runtime_env passes them on to the
# proxies it creates. gRPC: the proxy streams a replica's ASGI messages over the replica's gRPC server instead of
# Ray's object-ref streaming generator, about a third less proxy CPU per SSE event. The router on the proxy's own
# event loop saves a thread hop per event. (README, "Serving": measured side by side with --no-ray.)
SERVE_ENV_VARS = REPLICA_ENV_VARS | {"RAY_SERVE_PROXY_USE_GRPC": "1", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


@serve.ingress()
class LLMServer:
    """One replica, one engine, the OpenAI app over it. /metrics answers from the replica that gets the request,
    its series labelled with that replica's id; the same series go to Ray's metrics from every replica."""

    async def __init__(self, config: EngineConfig) -> None:
        replica = serve.get_replica_context().replica_id.unique_id
        model_name = served_model_name(config.model_config)
        self.metrics = PrometheusStatLogger(model_name, config.cache_config, replica)
        ray_metrics = RayPrometheusStatLogger(model_name, config.cache_config, replica)
        self.engine = AsyncLLM(config, stat_loggers=[self.metrics, ray_metrics])
        await self.engine.wait_until_ready()
        self.api_key = config.serving_config.api_key

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_fastapi_app(EngineModelRouter(self.engine), self.api_key, self.metrics)

    async def check_health(self) -> None:
        await self.engine.check_health()

    def __del__(self) -> None:
        self.engine.shutdown()


def start_serve(host: str, port: int) -> None:
    """serve.start with raylm's settings for Serve's own actors. Like any serve.start, it changes nothing where Serve
    already runs on the cluster (Serve warns)."""
    serve.start(http_options={"host": host, "port": port},
                controller_options={"runtime_env": {"env_vars": SERVE_ENV_VARS}})


def build_app(args: dict[str, Any]) -> serve.Application:
    """`args`: "config" (a YAML of engine settings) and any engine setting on top, e.g. "model",
    "min_replicas", "max_replicas", "tensor_parallel_size"."""
    settings = dict(args)
    return build_openai_app(make_engine_config(settings.pop("config", None), **settings))


def build_openai_app(config: EngineConfig) -> serve.Application:
    model_id = served_model_name(config.model_config)
    config.model_config.served_model_name = model_id
    return serve.deployment(LLMServer).options(name=f"LLMServer:{model_id}", **llm_server_options(config)).bind(config)


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
        "ray_actor_options": {"num_cpus": 1, "num_gpus": 1 if _replica_holds_device(config) else 0,
                              "runtime_env": _replica_runtime_env()},
    }


def _replica_runtime_env() -> dict[str, Any]:
    """The driver's runtime_env (what Serve gives a deployment that sets none) plus REPLICA_ENV_VARS."""
    job_env = dict(ray.get_runtime_context().runtime_env) if ray.is_initialized() else {}
    return job_env | {"env_vars": {**job_env.get("env_vars", {}), **REPLICA_ENV_VARS}}


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
    if workers_on_ray(config.parallel_config):
        return False
    if config.model_config.device == "auto" and not ray.is_initialized():
        return False  # `serve run module:app` builds before connecting: no cluster to ask yet
    # The replica is a Ray actor: "auto" follows the cluster's GPUs, as for the Ray executor's workers.
    return resolve_device(config.model_config, on_ray=True) == "cuda"
