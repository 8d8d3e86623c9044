"""Disaggregated prefill and decode on Ray Serve (the shape of Ray Serve LLM's build_pd_openai_app): a prefill
deployment (engines with kv_role kv_producer) and a decode deployment (kv_consumer) behind one OpenAI ingress, each
autoscaled on its own settings.

    import_path: raylm.cluster.serve.serve_pd:build_pd_openai_app
    args:
      prefill_config: {config: raylm/configs/tiny.yaml, min_replicas: 1, max_replicas: 2}
      decode_config: {config: raylm/configs/tiny.yaml, min_replicas: 1, max_replicas: 4}

Each side's settings are build_app's (a YAML under "config", any engine setting on top). kv_connector defaults to
RayKVConnector with the side's role; a side given another connector must give it a role that fits. The ingress sends
each request (one prompt, n = 1) to a prefill replica for one token, then with its kv_transfer_params to a decode
replica, which takes the prompt's KV from the prefill node's store and streams the answer; other requests are served
by the decode side alone. The prefill side is routed by prefix under its routing_policy, the decode side by load.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ray import serve

from raylm.cluster.engine.config_resolver import replica_deployment
from raylm.cluster.models.default_model import served_model_name
from raylm.cluster.serve.app import LLMEngineServer, llm_server_options
from raylm.cluster.serve.serve_ingress import OpenAIIngress, ingress_options
from raylm.cluster.serve.serve_router import prefix_router_config
from raylm.configs import EngineConfig, make_engine_config

_ROLES = {"prefill_config": ("kv_producer", "kv_both"), "decode_config": ("kv_consumer", "kv_both")}


def pd_engine_config(args: dict[str, Any], side: str) -> EngineConfig:
    """One side's engine config from its args, with RayKVConnector in the side's role unless a connector is given."""
    settings = dict(args.get(side) or {})
    if not settings:
        raise ValueError(f"{side}: give the {side.split('_')[0]} side's settings (config: <yaml>, overrides)")
    roles = _ROLES[side]
    if settings.get("kv_connector") is None and settings.get("kv_transfer_config") is None:
        settings |= {"kv_connector": "RayKVConnector", "kv_role": roles[0]}
    config = make_engine_config(settings.pop("config", None), **settings)
    role = config.kv_transfer_config.kv_role
    if role not in roles:
        raise ValueError(f"{side}.kv_role: the {side.split('_')[0]} side needs {' or '.join(roles)}, got {role!r}")
    return config


def build_pd_openai_app(args: dict[str, Any]) -> serve.Application:
    """`args`: "prefill_config" and "decode_config" (each side's settings), and optionally "api_key"."""
    prefill, decode = pd_engine_config(args, "prefill_config"), pd_engine_config(args, "decode_config")
    model_id = served_model_name(decode.model_config)
    prefill, decode = (dataclasses.replace(config, model_config=config.model_config.model_copy(
        update={"served_model_name": model_id})) for config in (prefill, decode))
    if prefill.cache_config.block_size != decode.cache_config.block_size:
        raise ValueError(f"block_size: the prefill side's ({prefill.cache_config.block_size}) and the decode side's "
                         f"({decode.cache_config.block_size}) must be equal for the KV to move between them")
    prefill_deployment = replica_deployment(prefill)
    prefill_options = llm_server_options(prefill, prefill_deployment)
    if prefill.serving_config.max_replicas > 1 and prefill_deployment.routing_policy == "prefix":
        prefill_options["request_router_config"] = prefix_router_config(prefill.routing_config)
    # Ray types serve.deployment as returning a decorator, also when given the class: hence the ignores.
    prefill_server = serve.deployment(LLMEngineServer).options(  # type: ignore[attr-defined]
        name=f"LLMServer:prefill:{model_id}", **prefill_options)
    decode_server = serve.deployment(LLMEngineServer).options(  # type: ignore[attr-defined]
        name=f"LLMServer:decode:{model_id}", **llm_server_options(decode, replica_deployment(decode)))
    serving = decode.serving_config
    return serve.deployment(OpenAIIngress).options(  # type: ignore[attr-defined]
        **ingress_options(f"PDProxy:{model_id}", serving.min_replicas, serving.max_replicas)
    ).bind(decode_server.bind(decode), args.get("api_key", serving.api_key), prefill_server.bind(prefill))
