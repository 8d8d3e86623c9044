"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's), only when runtime adapter updates are allowed:
RAYLM_ALLOW_RUNTIME_LORA_UPDATING=1 (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING is honoured too), since they let any
client make the server read a folder of its disk."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import PlainTextResponse

from raylm.cluster.entrypoints.openai.protocol import OpenAIBaseModel
from raylm.cluster.entrypoints.openai.serving_models import OpenAIServingModels
from raylm.configs import envs


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str


def include_lora_endpoints(app: FastAPI, models: OpenAIServingModels, dependencies: list[Any]) -> None:
    """`dependencies`: the /v1 routes' (the API key check)."""
    if not envs.runtime_lora_updating():
        return
    router = APIRouter(prefix="/v1", dependencies=dependencies)

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> PlainTextResponse:
        await models.load_lora_adapter(request.lora_name, request.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        await models.unload_lora_adapter(request.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")

    app.include_router(router)
