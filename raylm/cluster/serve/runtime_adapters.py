"""LoRA adapters loaded at run time on Serve (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter` on the fleet ingress,
under the same RAYLM_ALLOW_RUNTIME_LORA_UPDATING opt-in as `--no-ray`): they must reach every replica of the model,
including one that autoscaling starts later.

Each model's deployment keeps its run-time adapters (name -> path) in one AdapterTable actor. A load is written there
first, then broadcast to the replicas that run now (`DeploymentHandle.broadcast`); a replica that fails it (a bad path,
a rank over max_lora_rank) makes the load a client error, undone everywhere. A replica reads the table when it starts
and every SYNC_INTERVAL_S after (ReplicaAdapters.keep_synced), which also covers one that started while a broadcast
was on its way.
"""
from __future__ import annotations

from http import HTTPStatus
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from raylm.cluster.entrypoints.openai.errors import OpenAIError
from raylm.cluster.entrypoints.openai.protocol import ErrorResponse

# How often a replica compares its adapters with its deployment's table.
SYNC_INTERVAL_S = 10.0


@ray.remote(num_cpus=0)
class AdapterTable:
    """One deployment's run-time adapters, name -> path."""

    def __init__(self) -> None:
        self.adapters: dict[str, str] = {}

    def add(self, name: str, path: str) -> bool:
        """False (and nothing changed) if the name is taken."""
        if name in self.adapters:
            return False
        self.adapters[name] = path
        return True

    def remove(self, name: str) -> bool:
        return self.adapters.pop(name, None) is not None

    def snapshot(self) -> dict[str, str]:
        return dict(self.adapters)


def adapter_table(app_name: str, deployment_name: str) -> Any:
    """The deployment's AdapterTable, created by whoever asks first. Detached, so that it outlives any one replica or
    ingress; Serve's controller kills it on serve.shutdown()."""
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    # mypy keeps a decorated class's own type: ray.remote made AdapterTable an ActorClass.
    table = AdapterTable.options(  # type: ignore[attr-defined]
        name=f"raylm-adapters:{app_name}:{deployment_name}", namespace=SERVE_NAMESPACE, get_if_exists=True,
        lifetime="detached").remote()
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    controller._register_shutdown_cleanup_actor.remote(table)
    return table


class RuntimeAdapters:
    """The fleet ingress's side: loads and unloads on every replica of one model's deployment."""

    def __init__(self, server: DeploymentHandle, deployment_name: str) -> None:
        self.server = server
        self.table = adapter_table(serve.get_replica_context().app_name, deployment_name)

    async def load(self, name: str, path: str) -> None:
        if not await self.table.add.remote(name, path):
            raise OpenAIError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        answers: list[ErrorResponse | None] = await self._broadcast("add_adapter", name, path)
        errors = [answer for answer in answers if answer is not None]
        if errors:  # undone on the replicas that took it: a load happens everywhere or nowhere
            await self.table.remove.remote(name)
            await self._broadcast("remove_adapter", name)
            error = errors[0].error
            raise OpenAIError(error.message, HTTPStatus(error.code), error.param)

    async def unload(self, name: str) -> None:
        in_table = await self.table.remove.remote(name)
        removed: list[bool] = await self._broadcast("remove_adapter", name)
        if not in_table and not any(removed):
            raise OpenAIError(f"The lora adapter '{name}' cannot be found.", HTTPStatus.NOT_FOUND,
                              param="lora_name")

    async def _broadcast(self, method: str, *args: Any) -> list[Any]:
        """Every running replica's answer (LLMEngineServer.add_adapter, remove_adapter)."""
        return await self.server.broadcast(method, *args).results_async()
