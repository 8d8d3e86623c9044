"""The CPU layer stack (runner/models/cpu_layer_stack.py): steps whose linears all take the skinny kernel run the
decoder layers in one kernel call, with the same tokens and logprobs, bit for bit, as the module-by-module path
that enforce_eager keeps; layers it cannot run as written keep that path."""
from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from raylm.cluster import LLM, SamplingParams
from raylm.runner import cpu_kernels
from raylm.runner.layers import cpu_gemm
from raylm.runner.layers.cpu_gemm import ROW_BUCKETS, GemmPlan
from raylm.runner.models.cpu_layer_stack import CpuLayerStack

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None or not torch.backends.mkldnn.is_available(),
                                reason="needs raylm's CPU kernels and oneDNN")

SKINNY_ROWS = 64
SCHEDULES = {
    "prompts_in_one_step": dict(max_num_batched_tokens=1024),  # prefill past 64 rows: the modules; decodes: the stack
    "chunked_prefill": dict(max_num_batched_tokens=32),  # prompt chunks beside decodes, all through the stack
}


@pytest.fixture
def skinny_plans(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every shape planned to the skinny kernel up to 64 rows and oneDNN past them (what a 2-core EPYC times for
    SmolLM2's shapes), without timing: the tiny test shapes could time either way."""
    monkeypatch.setenv("RAYLM_CACHE_DIR", str(tmp_path))
    plan = GemmPlan(tuple("skinny" if rows <= SKINNY_ROWS else "onednn" for rows in ROW_BUCKETS))
    monkeypatch.setattr(cpu_gemm, "time_kernels", lambda layers: (plan, {}))


@pytest.fixture
def stack_rows(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The rows of every step the stack runs (the engine runs in this process)."""
    rows: list[int] = []
    forward = CpuLayerStack.forward

    def counted(self: CpuLayerStack, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        rows.append(hidden_states.shape[0])
        return forward(self, positions, hidden_states, residual)

    monkeypatch.setattr(CpuLayerStack, "forward", counted)
    yield rows


def generate(path: Path, **settings: Any) -> list[tuple[list[int], Any]]:
    llm = LLM(model=str(path), max_model_len=256, block_size=16, enable_prefix_caching=False, max_num_seqs=8,
              **settings)
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 512) for _ in range(n)] for n in (3, 17, 40, 90)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.shutdown()
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_stacked_steps_equal_the_module_path_bit_for_bit(arch: str, schedule: str, checkpoints: dict[str, Path],
                                                         skinny_plans: None, stack_rows: list[int]) -> None:
    stacked = generate(checkpoints[arch], **SCHEDULES[schedule])
    assert stack_rows and max(stack_rows) <= SKINNY_ROWS
    if schedule == "chunked_prefill":
        assert max(stack_rows) > 4, "prompt chunks (more rows than requests) took the stack too"
    taken = len(stack_rows)
    eager = generate(checkpoints[arch], enforce_eager=True, **SCHEDULES[schedule])
    assert len(stack_rows) == taken, "enforce_eager runs module by module"
    assert stacked == eager


def test_layers_it_cannot_run_as_written_keep_the_module_path(checkpoints: dict[str, Path], skinny_plans: None,
                                                              stack_rows: list[int]) -> None:
    generate(checkpoints["qwen3"])  # q/k norm inside the attention
    generate(checkpoints["llama"], custom_ops="none")  # raylm's CPU kernels off
    assert stack_rows == []
