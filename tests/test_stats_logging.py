"""The periodic engine stats line (vLLM's LoggingStatLogger): its figures, and that the offline path logs it."""
from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.engine.stats import LoggingStatLogger, SchedulerStats


def test_the_line_reports_the_interval() -> None:
    last = SchedulerStats(prefix_cache_queries=100, prefix_cache_hits=10, num_prompt_tokens=500,
                          num_generation_tokens=40, num_preemptions=1)
    now = SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.125, prefix_cache_queries=300,
                         prefix_cache_hits=60, num_prompt_tokens=1500, num_generation_tokens=240, num_preemptions=4)
    assert LoggingStatLogger.format(1, now, last, 2.0) == (
        "Engine 001: Avg prompt throughput: 500.0 tokens/s, Avg generation throughput: 100.0 tokens/s, "
        "Running: 3 reqs, Waiting: 2 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 25.0%, Preemptions: 3")
    assert LoggingStatLogger.format(0, last, last, 2.0) is None  # idle all along: nothing to say


def test_offline_generate_logs_stats_lines(llama_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="raylm.stats")
    llm = LLM(model=str(llama_path), max_model_len=256, log_stats_interval_s=0.005, block_size=16)
    prompts = [{"prompt_token_ids": [5 + i] + list(range(6, 25))} for i in range(4)]
    llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
    lines = [record.getMessage() for record in caplog.records if record.name == "raylm.stats"]
    assert lines, "no stats line"
    pattern = (r"Engine 000: Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: [\d.]+ tokens/s, "
               r"Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: [\d.]+%, Prefix cache hit rate: [\d.]+%, "
               r"Preemptions: \d+")
    assert all(re.fullmatch(pattern, line) for line in lines), lines
    stats = llm.llm_engine.engine_core.engine_stats()[0]
    assert stats.num_generation_tokens == 160
    assert stats.num_prompt_tokens == 4 * 20  # whole prompts, as vllm:prompt_tokens counts them
    # Again: the first 16-token block of each prompt is now a prefix-cache hit, and still a prompt token.
    llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    stats = llm.llm_engine.engine_core.engine_stats()[0]
    assert stats.prefix_cache_hits == 4 * 16 and stats.num_prompt_tokens == 8 * 20
    llm.shutdown()

    quiet = LLM(model=str(llama_path), max_model_len=256, disable_log_stats=True)
    assert quiet.stat_logger is None
    quiet.shutdown()
