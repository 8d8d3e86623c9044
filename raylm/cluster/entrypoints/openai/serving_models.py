"""The models the OpenAI server offers (vLLM's OpenAIServingModels): the base model and its LoRA adapters, each a
model of its own name. Adapters come from the lora_modules (loaded with the engine), from /v1/load_lora_adapter, or
on demand from dynamic_lora_loading_path when a request names one found there."""
from __future__ import annotations

import asyncio
from http import HTTPStatus

from raylm.cluster.engine.async_llm import AsyncLLM
from raylm.cluster.engine.lora_registry import LoRARegistry
from raylm.cluster.entrypoints.openai.errors import OpenAIError
from raylm.cluster.entrypoints.openai.protocol import ModelCard
from raylm.common.lora_request import LoRARequest


class OpenAIServingModels:
    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = engine
        self._lock = asyncio.Lock()  # one load or unload at a time: a name is never loaded twice

    async def registry(self) -> LoRARegistry:
        await self.engine.wait_until_ready()
        return self.engine.lora_registry

    async def model_cards(self) -> list[ModelCard]:
        registry = await self.registry()
        config = self.engine.engine_config
        base = self.engine.model_name
        cards = [ModelCard(id=base, root=config.model_info.path, max_model_len=config.model_config.max_model_len)]
        loaded = registry.adapters
        cards += [ModelCard(id=name, root=lora.lora_path, parent=base) for name, lora in loaded.items()]
        cards += [ModelCard(id=name, root=str(registry.dynamic_folder(name)), parent=base)
                  for name in registry.dynamic_names() if name not in loaded]
        return cards

    async def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model), loading it from the dynamic folder if it is
        there; 404 for a model that is neither."""
        registry = await self.registry()
        if model is None or model == self.engine.model_name:
            return None
        lora = registry.get(model)
        if lora is not None:
            return lora
        folder = registry.dynamic_folder(model)
        if folder is None:
            served = [self.engine.model_name, *registry.adapters]
            raise OpenAIError(f"The model `{model}` does not exist; served: {served}", HTTPStatus.NOT_FOUND,
                              param="model")
        async with self._lock:
            return registry.get(model) or await self._load(registry, model, str(folder))

    async def load_lora_adapter(self, name: str, path: str) -> LoRARequest:
        registry = await self.registry()
        async with self._lock:
            return await self._load(registry, name, path)

    async def unload_lora_adapter(self, name: str) -> LoRARequest:
        registry = await self.registry()
        async with self._lock:
            lora = registry.get(name)
            if lora is None:
                raise OpenAIError(f"The lora adapter '{name}' cannot be found.", HTTPStatus.NOT_FOUND,
                                  param="lora_name")
            await self.engine.remove_lora(lora.lora_int_id)
            registry.unregister(name)
            return lora

    async def _load(self, registry: LoRARegistry, name: str, path: str) -> LoRARequest:
        try:
            lora = registry.new_request(name, path)
            await self.engine.add_lora(lora)
        except ValueError as err:
            raise OpenAIError(str(err), param="lora_path") from None
        registry.register(lora)
        return lora
