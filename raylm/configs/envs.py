"""The environment variables raylm reads (vLLM keeps its own in `vllm/envs.py`).

They cover what is set per machine or per deployment rather than per engine: where built artefacts are cached, and
how long to wait for a Ray cluster to make room. Read at use, so a test or a Ray job can set them late.
"""
from __future__ import annotations

import os
from pathlib import Path

RAYLM_CACHE_DIR = "RAYLM_CACHE_DIR"
RAYLM_PLACEMENT_GROUP_TIMEOUT_S = "RAYLM_PLACEMENT_GROUP_TIMEOUT_S"
# vLLM's VLLM_SERVER_DEV_MODE: development-only routes (/sleep, /wake_up, /is_sleeping) on the OpenAI server.
RAYLM_SERVER_DEV_MODE = "RAYLM_SERVER_DEV_MODE"
# vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING (also honoured): /v1/load_lora_adapter and /v1/unload_lora_adapter.
RAYLM_ALLOW_RUNTIME_LORA_UPDATING = "RAYLM_ALLOW_RUNTIME_LORA_UPDATING"
# vLLM's PG_WAIT_TIMEOUT: a cluster may be scaling up to fit the group.
DEFAULT_PLACEMENT_GROUP_TIMEOUT_S = 1800.0


def cache_dir() -> Path:
    """The user cache of built artefacts (the tiny default model, the CPU kernels): $RAYLM_CACHE_DIR, else
    $XDG_CACHE_HOME/raylm, else ~/.cache/raylm."""
    if os.environ.get(RAYLM_CACHE_DIR):
        return Path(os.environ[RAYLM_CACHE_DIR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "raylm"


def placement_group_timeout_s() -> float:
    """Seconds to wait for a placement group the cluster could hold but has no room for yet."""
    value = os.environ.get(RAYLM_PLACEMENT_GROUP_TIMEOUT_S)
    if not value:
        return DEFAULT_PLACEMENT_GROUP_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{RAYLM_PLACEMENT_GROUP_TIMEOUT_S} must be a number of seconds > 0, got {value!r}")
    return seconds


def runtime_lora_updating() -> bool:
    """Whether the OpenAI server loads and unloads LoRA adapters over HTTP: RAYLM_ALLOW_RUNTIME_LORA_UPDATING (or
    vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING) is 1 or true."""
    return any(os.environ.get(name, "0").strip().lower() in ("1", "true")
               for name in (RAYLM_ALLOW_RUNTIME_LORA_UPDATING, "VLLM_ALLOW_RUNTIME_LORA_UPDATING"))


def server_dev_mode() -> bool:
    """Whether the OpenAI server adds its development routes: $RAYLM_SERVER_DEV_MODE is 1 (or true)."""
    return os.environ.get(RAYLM_SERVER_DEV_MODE, "0").strip().lower() in ("1", "true")
