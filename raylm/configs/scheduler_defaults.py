"""The scheduler's default that depends on the device and the entrypoint, decided once at resolution: how many prompt
tokens a step may compute beside running decodes (`SchedulerConfig.max_prefill_tokens_with_decodes`, see
cluster/core/step_budget.py).

On CPU a decode step is bound by reading the weights, and a prompt token costs about a twentieth of it on top
(SmolLM2 float32: 8 decodes ~16 prompt tokens' time), so a prompt computed beside decodes holds them for the prompt's
whole time; chunks of CPU_SERVING_PREFILL_TOKENS keep a step with a chunk under about twice a decode step
(docs/scheduling.md#prompts-beside-decodes). Only where streams wait on tokens, a server: an offline batch (`LLM`)
wants its prompts in as fast as the budget allows, so that its decode batch fills (vLLM too gives `LLM` and its server
different budgets). On CUDA the cap stays off: a step of max_num_batched_tokens is short there, and small chunks would
idle the device.
"""
from __future__ import annotations

from raylm.configs.engine_config import SchedulerConfig

CPU_SERVING_PREFILL_TOKENS = 32


def resolve_scheduler_config(config: SchedulerConfig, device: str, serving: bool) -> SchedulerConfig:
    """`config` with `max_prefill_tokens_with_decodes` decided where it is None, for `device` ("cpu" or "cuda") and
    the entrypoint (`serving`: an OpenAI server or Serve replica streams tokens; False: an offline `LLM`)."""
    if config.max_prefill_tokens_with_decodes is not None:
        return config
    on = device == "cpu" and serving and config.enable_chunked_prefill
    return config.model_copy(update={"max_prefill_tokens_with_decodes": CPU_SERVING_PREFILL_TOKENS if on else 0})
