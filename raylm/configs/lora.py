"""The LoRA settings decided once, when the engine's config is resolved (raylm/cluster/engine/config_resolver.py)."""
from __future__ import annotations

from raylm.configs.engine_config import LoRAConfig
from raylm.configs.model_info import ModelInfo


def parse_lora_modules(lora_modules: list[str] | None) -> dict[str, str]:
    """`lora_modules` ("name=path" each, vLLM's --lora-modules form) as {name: path}."""
    adapters: dict[str, str] = {}
    for entry in lora_modules or []:
        name, sep, path = entry.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ValueError(f"lora_modules: {entry!r} is not name=path (e.g. sql-lora=/adapters/sql)")
        if name in adapters:
            raise ValueError(f"lora_modules: the adapter name {name!r} is given twice")
        adapters[name] = path
    return adapters


def resolve_lora_config(lora: LoRAConfig, model_info: ModelInfo, served_model_name: str | None) -> LoRAConfig:
    """`lora` with max_cpu_loras decided; LoRA settings that cannot be honoured are refused."""
    if not lora.enable_lora:
        ignored = sorted(lora.model_fields_set - {"enable_lora"})
        if ignored:
            raise ValueError(f"{', '.join(ignored)}: LoRA settings need enable_lora=True")
        return lora
    if model_info.is_moe:
        raise ValueError(f"enable_lora: {model_info.architecture} is a mixture-of-experts model; raylm applies LoRA "
                         f"to dense models only (its expert layers have no LoRA path)")
    max_cpu_loras = lora.max_cpu_loras or lora.max_loras
    if max_cpu_loras < lora.max_loras:
        raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({lora.max_loras}): every adapter "
                         f"on the device is also kept in host memory")
    names = parse_lora_modules(lora.lora_modules)
    if served_model_name is not None and served_model_name in names:
        raise ValueError(f"lora_modules: the adapter name {served_model_name!r} is the base model's name")
    return lora.model_copy(update={"max_cpu_loras": max_cpu_loras})
