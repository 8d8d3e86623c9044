"""The step's token budget beside running decodes: max_prefill_tokens_with_decodes (cluster/core/step_budget.py) and
its default (configs/scheduler_defaults.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from raylm.cluster.core.scheduler import Scheduler
from raylm.cluster.engine.config_resolver import resolve_engine_config
from raylm.configs import make_engine_config
from raylm.configs.engine_config import CacheConfig, SchedulerConfig
from raylm.configs.scheduler_defaults import (
    CPU_SERVING_PREFILL_TOKENS,
    CPU_SERVING_PREFILL_TOKENS_FLOAT32,
    UsageContext,
    resolve_scheduler_config,
)
from tests.test_scheduler import BLOCK_SIZE, FakeRunner, expected_tokens, make_request, run, step


def make_scheduler(chunk: int, max_num_batched_tokens: int = 64, **settings: object) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=16,
                             max_prefill_tokens_with_decodes=chunk, **settings)
    return Scheduler(config, CacheConfig(block_size=BLOCK_SIZE), 128, 64, BLOCK_SIZE)


def start_decoding(scheduler: Scheduler, runner: FakeRunner, names: str) -> None:
    for name in names:
        scheduler.add_request(make_request(name, 4, max_tokens=30))
    out, _ = step(scheduler, runner)
    assert out.num_scheduled_tokens == dict.fromkeys(names, 4)  # no decode yet: prompts take what they need


def test_a_long_prompt_is_chunked_while_the_decodes_keep_running() -> None:
    scheduler, runner = make_scheduler(chunk=8), FakeRunner()
    start_decoding(scheduler, runner, "abc")
    long = make_request("long", 40, max_tokens=3)
    scheduler.add_request(long)
    steps = [step(scheduler, runner)[0] for _ in range(5)]
    for out in steps:  # every decode every step, beside at most one chunk of the prompt
        assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1, "long": 8}
        assert out.total_num_scheduled_tokens == 11 <= scheduler.max_num_batched_tokens
    results = run(scheduler, runner)
    assert results["long"].token_ids == expected_tokens(long, 3)[1:]  # its first token came with the last chunk
    assert all(len(results[name].token_ids) == 30 - 6 for name in "abc")


def test_the_chunk_bounds_all_prompts_of_a_step_together() -> None:
    """Unlike long_prefill_token_threshold (per request), prompts arriving together share one chunk."""
    scheduler, runner = make_scheduler(chunk=12), FakeRunner()
    start_decoding(scheduler, runner, "a")
    for name in ("p", "q", "r"):
        scheduler.add_request(make_request(name, 10, max_tokens=2))
    prefill_tokens = []
    for _ in range(3):
        out, _ = step(scheduler, runner)
        assert out.num_scheduled_tokens["a"] == 1
        prefill_tokens.append({k: v for k, v in out.num_scheduled_tokens.items() if k != "a"})
    # p whole (10) and q's first 2; q's rest and r's first 4 (p decodes now: its token is no prompt's); r's rest
    assert prefill_tokens == [{"p": 10, "q": 2}, {"p": 1, "q": 8, "r": 4}, {"q": 1, "r": 6}]
    run(scheduler, runner)


def test_without_decodes_prompts_take_the_whole_budget() -> None:
    scheduler, runner = make_scheduler(chunk=8), FakeRunner()
    scheduler.add_request(make_request("long", 40, max_tokens=3))
    scheduler.add_request(make_request("next", 40, max_tokens=3))
    out, _ = step(scheduler, runner)
    assert out.num_scheduled_tokens == {"long": 40, "next": 24}


def test_the_chunk_needs_chunked_prefill() -> None:
    with pytest.raises(ValidationError, match="max_prefill_tokens_with_decodes .*enable_chunked_prefill"):
        SchedulerConfig(max_prefill_tokens_with_decodes=64, enable_chunked_prefill=False)


@pytest.mark.parametrize(("given", "device", "dtype", "usage_context", "chunked", "resolved"), [
    (None, "cpu", "bfloat16", "openai_api_server", True, CPU_SERVING_PREFILL_TOKENS),
    (None, "cpu", "float32", "openai_api_server", True, CPU_SERVING_PREFILL_TOKENS_FLOAT32),
    (None, "cpu", "float32", "llm_class", True, 0),  # an offline batch fills its decode batch first
    (None, "cpu", "bfloat16", "openai_batch_runner", True, 0),
    (None, "cuda", "bfloat16", "openai_api_server", True, 0),
    (None, "cpu", "float32", "openai_api_server", False, 0),  # a prompt must then fit one step whole
    (16, "cuda", "bfloat16", "llm_class", True, 16),  # the user's choice stands
    (0, "cpu", "float32", "openai_api_server", True, 0),
])
def test_default(given: int | None, device: str, dtype: str, usage_context: UsageContext, chunked: bool,
                 resolved: int) -> None:
    config = SchedulerConfig(max_prefill_tokens_with_decodes=given, enable_chunked_prefill=chunked,
                             max_num_batched_tokens=8192)
    assert resolve_scheduler_config(config, device, dtype, usage_context).max_prefill_tokens_with_decodes == resolved


def test_resolution_decides_the_default_for_its_entrypoint(llama_path: Path) -> None:
    """The engine's resolution passes its entrypoint and dtype on: a server's engine gets the CPU chunk (float32's, the
    tiny checkpoint's dtype), an LLM's none."""
    settings = make_engine_config(model=str(llama_path), device="cpu")
    served = resolve_engine_config(settings, "openai_api_server").scheduler_config
    offline = resolve_engine_config(settings, "llm_class").scheduler_config
    assert (served.max_prefill_tokens_with_decodes, offline.max_prefill_tokens_with_decodes) == (
        CPU_SERVING_PREFILL_TOKENS_FLOAT32, 0)
