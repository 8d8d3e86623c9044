"""PrefixAwareRequestRouter: Ray Serve's custom request router API (`ray.serve.request_router.RequestRouter`, as Ray
Serve LLM's PrefixCacheAffinityRouter uses it) with raylm's PrefixRouter, for LLMServer replicas called through a
deployment handle (raylm's OpenAI ingress, PD proxy and fleet ingress).

Serve asks `choose_replicas` for ranks of replicas and sends the request to the least loaded available one of the
first rank it can. Here the first rank is PrefixRouter's choice: the replica whose recent prompts share the longest
prefix with this one while the replicas' ongoing requests are within routing_imbalanced_threshold of each other, else
the least loaded; the rest follow. Prompts are matched by 64-byte chunks of their text (about one 16-token block),
since the router runs before any tokenizer. The index lives in one PrefixIndex actor per deployment, shared by every
router (one per ingress replica), so a conversation keeps its replica whichever ingress replica the proxy picks
(as Ray Serve LLM shares its prefix tree); Serve kills the actor on `serve.shutdown()`.
"""
from __future__ import annotations

import json
from typing import Any

import ray
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from raylm.cluster.dp.prefix_router import PrefixRouter, text_block_hashes
from raylm.cluster.serve.asgi_relay import RelayedRequest
from raylm.configs.kv_transfer import RoutingConfig

# Prompt chunks an index keeps per replica (a replica's engine may cache more; a router outlives many prompts).
MAX_TRACKED_CHUNKS = 100_000


def prompt_text(request: Any) -> str:
    """The text a completion or chat request's prompt starts with (token ids as text: they only need to compare)."""
    messages = getattr(request, "messages", None)
    if messages is not None:
        return "".join(f"{message.role}\n{message.text()}\n" for message in messages)
    return _prompt_text(getattr(request, "prompt", None))


def relayed_prompt_text(request: RelayedRequest) -> str:
    """The same for a request the fleet ingress relays as it came (its JSON body): a conversation's messages one
    after the other, each as JSON, so that a longer conversation's text starts with a shorter one's."""
    try:
        payload = json.loads(request.body) if request.body else None
    except ValueError:
        return ""
    if not isinstance(payload, dict):
        return ""
    messages = payload.get("messages")
    if isinstance(messages, list):
        return "".join(json.dumps(message, sort_keys=True) for message in messages)
    return _prompt_text(payload.get("prompt"))


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return prompt[0]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]
    return ",".join(str(token) for token in prompt or [])


@ray.remote(num_cpus=0)
class PrefixIndex:
    """One deployment's PrefixRouter, shared by the routers of all its callers; targets are replica id strings."""

    def __init__(self, **routing: Any) -> None:
        self.prefix_router: PrefixRouter[str] = PrefixRouter(RoutingConfig(**routing))

    def choose(self, hashes: list[bytes], loads: dict[str, float]) -> str:
        for replica_id in loads:
            self.prefix_router.set_capacity(replica_id, MAX_TRACKED_CHUNKS)
        return self.prefix_router.choose(hashes, loads)

    def keep_only(self, live: list[str]) -> None:
        for replica_id in self.prefix_router.targets():
            if replica_id not in live:
                self.prefix_router.remove(replica_id)


class PrefixAwareRequestRouter(RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        """kwargs: RoutingConfig's fields (routing_imbalanced_threshold, routing_match_rate_threshold)."""
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        deployment = self._deployment_id
        # mypy keeps a decorated class's own type: ray.remote made PrefixIndex an ActorClass.
        self.index = PrefixIndex.options(  # type: ignore[attr-defined]
            name=f"raylm-prefix-index:{deployment.app_name}:{deployment.name}", namespace=SERVE_NAMESPACE,
            get_if_exists=True, lifetime="detached").remote(**kwargs)
        # Detached so that it outlives any one caller; Serve's controller kills it on serve.shutdown().
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        ray.get(controller._register_shutdown_cleanup_actor.remote(self.index))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            return [candidate_replicas]
        hashes = text_block_hashes(request_text(pending_request.args))
        by_id = {replica.replica_id.to_full_id_str(): replica for replica in candidate_replicas}
        cache = self.replica_queue_len_cache
        loads = {key: float(cache.get(replica.replica_id) or 0) for key, replica in by_id.items()}
        try:
            chosen = await self.index.choose.remote(hashes, loads)
        except ray.exceptions.RayActorError:  # the index is gone (its node died): route by load alone meanwhile
            chosen = min(loads, key=loads.__getitem__)
        return [[by_id[chosen]], [replica for key, replica in by_id.items() if key != chosen]]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.index.keep_only.remote([replica.replica_id.to_full_id_str() for replica in replicas])


def request_text(args: list[Any]) -> str:
    """The prompt text of a handle call's request: a parsed OpenAI request (the OpenAI ingress, the PD proxy) or a
    relayed HTTP request (the fleet ingress)."""
    for arg in args:
        if isinstance(arg, RelayedRequest):
            return relayed_prompt_text(arg)
        if hasattr(arg, "model_fields"):
            return prompt_text(arg)
    return ""


def prefix_router_config(routing: RoutingConfig) -> Any:
    """The request_router_config of a deployment routed by prefix."""
    from ray.serve.config import RequestRouterConfig

    # Ray annotates its **kwargs as dict[str, Any] (each keyword's type, not the mapping's).
    kwargs = {"routing_imbalanced_threshold": routing.routing_imbalanced_threshold,
              "routing_match_rate_threshold": routing.routing_match_rate_threshold}
    return RequestRouterConfig(request_router_class=PrefixAwareRequestRouter,  # type: ignore[arg-type]
                               request_router_kwargs=kwargs)
