"""LoRA under Ray Serve: model multiplexing, as Ray Serve LLM does it.

With enable_lora the model's replicas sit behind the fleet ingress (fleet.py), which reads each request's `model` and
hands the request to a replica through a handle whose multiplexed_model_id is the adapter's name (empty for the base
model), so that Serve's router picks a replica that already holds the adapter, else one with the fewest, which then
loads it (ReplicaAdapters: `serve.multiplexed` with max_num_models_per_replica = max_loras, least recently used
unloaded). The replica answers with the same FastAPI app it serves directly (raylm/cluster/serve/asgi_relay.py),
streaming included. Responses name the replica that answered in the x-raylm-replica header.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

from ray import serve
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
    """A replica's side of multiplexing: the adapter a relayed request names is loaded before the request runs. Its
    run-time adapters (runtime_adapters.py) follow its deployment's AdapterTable: loaded when the ingress broadcasts
    them or when this replica finds them in the table, and loaded again on use after multiplexing evicted them."""

    def __init__(self, models: OpenAIServingModels, max_loras: int, replica_id: str, table: Any) -> None:
        self.models, self.replica_id, self.table = models, replica_id, table
        self.runtime: dict[str, str] = {}  # the table as this replica last saw it
        self._lock = asyncio.Lock()  # one run-time adapter change at a time

        async def load(model_id: str) -> Any:
            await self._ensure_loaded(model_id)
            return LoadedAdapter(models, model_id)

        self.load_adapter = serve.multiplexed(max_num_models_per_replica=max_loras)(load)

    async def add(self, name: str, path: str) -> None:
        """A run-time adapter into the engine (OpenAIError if it cannot be), then into Serve's multiplexing, so that
        requests for it may come here."""
        async with self._lock:
            if self.runtime.get(name) != path:  # else the table's sync brought it already
                await self.models.load_lora_adapter(name, path)
                self.runtime[name] = path
        await self.load_adapter(name)

    async def remove(self, name: str) -> bool:
        """Whether the engine had it. Serve may still count it as this replica's until multiplexing evicts it: a
        request for it here is then a 404."""
        async with self._lock:
            self.runtime.pop(name, None)
            if (await self.models.registry()).get(name) is None:
                return False
            await self.models.unload_lora_adapter(name)
            return True

    async def sync(self) -> None:
        """This replica's run-time adapters made the table's."""
        table: dict[str, str] = await self.table.snapshot.remote()
        for name in [name for name, path in self.runtime.items() if table.get(name) != path]:
            await self.remove(name)
        for name, path in table.items():
            if self.runtime.get(name) != path:
                try:
                    await self.add(name, path)
                except OpenAIError:  # a load being undone: its broadcast will remove it
                    pass

    async def keep_synced(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.sync()

    async def relay(self, app: ASGIApp, request: RelayedRequest) -> AsyncGenerator[Message, None]:
        extra = [(REPLICA_HEADER.encode(), self.replica_id.encode())]
        model_id = serve.get_multiplexed_model_id()
        if model_id:
            try:
                await self.load_adapter(model_id)
                await self._ensure_loaded(model_id)  # a run-time adapter that Serve still counts here, unloaded since
            except OpenAIError as err:  # an unknown or unusable adapter: the client's 4xx
                body = error_from_exception(err).model_dump_json().encode()
                yield {"type": "http.response.start", "status": err.response.error.code,
                       "headers": [(b"content-type", b"application/json"), *extra]}
                yield {"type": "http.response.body", "body": body, "more_body": False}
                return
        async for message in relay(app, request, extra):
            yield message

    async def _ensure_loaded(self, name: str) -> None:
        """A run-time adapter from its path unless the engine has it; any other from lora_modules or
        dynamic_lora_loading_path (OpenAIServingModels.resolve)."""
        if name not in self.runtime:
            await self.models.resolve(name)
            return
        async with self._lock:
            path = self.runtime.get(name)
            if path is not None and (await self.models.registry()).get(name) is None:
                await self.models.load_lora_adapter(name, path)




def requested_model(body: bytes) -> str | None:
    """The `model` field of a JSON request body, if there is one."""
    try:
        payload = json.loads(body) if body else None
    except ValueError:
        return None
    model = payload.get("model") if isinstance(payload, dict) else None
    return model if isinstance(model, str) else None
