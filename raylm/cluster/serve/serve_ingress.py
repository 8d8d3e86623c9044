"""The OpenAI ingress deployment: the HTTP routes in front of LLMServer replicas that it reaches through a deployment
handle, so that a request router (PrefixAwareRequestRouter) sees each request's prompt and picks the replica. With a
prefill deployment beside it, it is the disaggregated prefill/decode proxy (serve_pd.py): each request is prefilled
there, then decoded, and streamed, by the decode replicas.

The direct app (app.py's LLMServer as the ingress, no hop between) is kept where nothing is to be routed: one
replica at most, or routing_policy "load" (Serve's own power-of-two-choices router at the proxy).
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve

from raylm.cluster.entrypoints.openai.api_server import build_app as build_fastapi_app
from raylm.cluster.serve.serve_handles import HandleModelRouter

# The ingress relays; its replicas need no core of their own, and it queues nothing itself.
INGRESS_OPTIONS: dict[str, Any] = {"max_ongoing_requests": 1_000_000, "ray_actor_options": {"num_cpus": 0}}


@serve.ingress()
class OpenAIIngress:
    """/v1 routes, /health and /metrics (a replica's, labelled with its id) over the LLMServer deployment."""

    def __init__(self, llm_server: Any, api_key: str | None, prefill_server: Any = None) -> None:
        self.router = HandleModelRouter(llm_server, prefill_server)
        self.api_key = api_key

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = build_fastapi_app(self.router, self.api_key)

        @app.get("/metrics")
        async def prometheus_metrics() -> Response:
            return Response(await self.router.metrics_text(), media_type=CONTENT_TYPE_LATEST)

        return app


def ingress_options(name: str, min_replicas: int, max_replicas: int) -> dict[str, Any]:
    return INGRESS_OPTIONS | {"name": name, "autoscaling_config": {
        "min_replicas": max(1, min_replicas), "max_replicas": max_replicas, "target_ongoing_requests": 64}}
