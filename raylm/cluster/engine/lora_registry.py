"""Adapters by name (vLLM's OpenAIServingModels keeps the same list): the `lora_modules` given at start-up, those
loaded at run time, and those found on demand in `dynamic_lora_loading_path`. Each gets an id never used before, so
a name loaded again after an unload never meets the KV cache of its predecessor."""
from __future__ import annotations

import itertools
from pathlib import Path

from raylm.common.lora_request import LoRARequest
from raylm.common.object_storage import folders_holding, is_object_uri, object_exists
from raylm.configs.engine_config import LoRAConfig
from raylm.configs.lora import parse_lora_modules


class LoRARegistry:
    def __init__(self, lora_config: LoRAConfig, base_model_name: str) -> None:
        self.enabled = lora_config.enable_lora
        self.base_model_name = base_model_name
        self.static_modules = parse_lora_modules(lora_config.lora_modules)
        self.dynamic_path = lora_config.dynamic_lora_loading_path
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def new_request(self, name: str, path: str) -> LoRARequest:
        """A LoRARequest with a fresh id for an adapter not registered yet; ValueError names the rule broken."""
        if not self.enabled:
            raise ValueError(f"LoRA adapter {name!r}: LoRA is not enabled; start the engine with enable_lora=True")
        if name == self.base_model_name:
            raise ValueError(f"LoRA adapter {name!r}: the name is the base model's")
        if name in self.adapters:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        return LoRARequest(name, next(self._ids), str(path))

    def register(self, lora_request: LoRARequest) -> None:
        self.adapters[lora_request.lora_name] = lora_request

    def unregister(self, name: str) -> LoRARequest:
        """KeyError if no adapter has that name."""
        return self.adapters.pop(name)

    def get(self, name: str) -> LoRARequest | None:
        return self.adapters.get(name)

    def dynamic_folder(self, name: str) -> Path | str | None:
        """The adapter's folder under dynamic_lora_loading_path (a local folder or an object-storage prefix), if
        there is one."""
        if not self.enabled or self.dynamic_path is None or "/" in name or name in ("", ".", ".."):
            return None
        if is_object_uri(self.dynamic_path):
            uri = f"{self.dynamic_path.rstrip('/')}/{name}"
            return uri if object_exists(f"{uri}/adapter_config.json", "dynamic_lora_loading_path") else None
        folder = Path(self.dynamic_path) / name
        return folder if folder.is_dir() else None

    def dynamic_names(self) -> list[str]:
        if not self.enabled or self.dynamic_path is None:
            return []
        if is_object_uri(self.dynamic_path):
            return folders_holding(self.dynamic_path, "adapter_config.json", "dynamic_lora_loading_path")
        if not Path(self.dynamic_path).is_dir():
            return []
        return sorted(p.name for p in Path(self.dynamic_path).iterdir() if (p / "adapter_config.json").is_file())
