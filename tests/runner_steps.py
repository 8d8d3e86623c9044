"""Driving a ModelRunner without the engine: a tiny scheduler of whole-prompt prefills (or chunks) and decodes that
hands out KV blocks in order, for tests of the runner's batch decision, padding and micro-batches."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from raylm.cluster.engine.config_resolver import resolve_engine_config
from raylm.common.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from raylm.common.sampling_params import SamplingParams
from raylm.configs import EngineConfig, make_engine_config
from raylm.runner.model_runner import ModelRunner
from raylm.runner.parallel_state import destroy_model_parallel, init_model_parallel

RUNNER_DEFAULTS = dict(block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)


@pytest.fixture
def model_parallel_of_one() -> None:
    """A world of one, whatever an earlier test left."""
    destroy_model_parallel()
    init_model_parallel()


def resolved_config(**settings: Any) -> EngineConfig:
    """The settings as an engine's layers take them: every `auto` decided (raylm/cluster/engine/config_resolver.py)."""
    return resolve_engine_config(make_engine_config(**settings))


def make_runner(model: Path | str, num_blocks: int = 32, device: str = "cpu", **settings: Any) -> ModelRunner:
    config = resolved_config(model=str(model), device=device, **{**RUNNER_DEFAULTS, **settings})
    runner = ModelRunner(config, torch.device(device))
    runner.load_model()
    runner.initialize_kv_cache(num_blocks)
    return runner


class Steps:
    """Requests by id: their blocks (taken in order from block 0) and tokens computed so far."""

    def __init__(self, block_size: int = RUNNER_DEFAULTS["block_size"]) -> None:
        self.block_size = block_size
        self.next_block = 0
        self.blocks: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    def _grow(self, req_id: str, num_tokens: int) -> list[int]:
        """The blocks `req_id` needs added to hold `num_tokens` tokens."""
        needed = -(-num_tokens // self.block_size) - len(self.blocks.setdefault(req_id, []))
        new = list(range(self.next_block, self.next_block + max(0, needed)))
        self.next_block += len(new)
        self.blocks[req_id] += new
        return new

    def schedule(self, prompts: dict[str, list[int]] | None = None,
                 decodes: dict[str, int] | None = None) -> SchedulerOutput:
        """New requests (whole prompts) and requests already held (`decodes`: tokens to compute, 1 for a decode)."""
        new_reqs, cached = [], CachedRequestData()
        num_scheduled: dict[str, int] = {}
        for req_id, prompt in (prompts or {}).items():
            blocks = self._grow(req_id, len(prompt))
            new_reqs.append(NewRequestData(req_id, prompt, [], SamplingParams(temperature=0.0, seed=0), blocks, 0))
            num_scheduled[req_id] = len(prompt)
            self.num_computed[req_id] = len(prompt)
        for req_id, count in (decodes or {}).items():
            computed = self.num_computed[req_id]
            cached.req_ids.append(req_id)
            cached.new_block_ids.append(self._grow(req_id, computed + count))
            cached.num_computed_tokens.append(computed)
            cached.new_token_ids.append([])
            num_scheduled[req_id] = count
            self.num_computed[req_id] = computed + count
        return SchedulerOutput(new_reqs, cached, num_scheduled, sum(num_scheduled.values()), set())


def run_step(runner: ModelRunner, scheduler_output: SchedulerOutput) -> tuple[dict[str, list[int]], torch.Tensor]:
    """One execute_model + sample_tokens: ({req_id: sampled tokens}, the logits of the sampling rows)."""
    assert runner.execute_model(scheduler_output) is None
    assert runner.execute_model_state is not None
    logits = runner.execute_model_state.logits.clone()
    output = runner.sample_tokens()
    assert output is not None
    return dict(zip(output.req_ids, output.sampled_token_ids)), logits
