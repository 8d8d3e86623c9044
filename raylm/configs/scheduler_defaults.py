"""The scheduler's device-dependent default, decided once at resolution: how many prompt tokens a step may compute
beside running decodes (`SchedulerConfig.max_prefill_tokens_with_decodes`, see cluster/core/step_budget.py).

On CPU a step's time grows with its tokens from a few dozen rows on (the linears are bound by compute there, where a
GPU still has idle units at thousands), so a prompt computed beside decodes holds them for the prompt's whole time.
CPU_PREFILL_TOKENS_WITH_DECODES was chosen on the served SmolLM2 load (docs/scheduling.md#prompts-beside-decodes).
On CUDA the cap stays off: a step of max_num_batched_tokens is short there, and small chunks would waste the device.
"""
from __future__ import annotations

from raylm.configs.engine_config import SchedulerConfig

CPU_PREFILL_TOKENS_WITH_DECODES = 64


def resolve_scheduler_config(config: SchedulerConfig, device: str) -> SchedulerConfig:
    """`config` with `max_prefill_tokens_with_decodes` decided for `device` ("cpu" or "cuda") where it is None."""
    if config.max_prefill_tokens_with_decodes is not None:
        return config
    chunk = CPU_PREFILL_TOKENS_WITH_DECODES if device == "cpu" and config.enable_chunked_prefill else 0
    return config.model_copy(update={"max_prefill_tokens_with_decodes": chunk})
