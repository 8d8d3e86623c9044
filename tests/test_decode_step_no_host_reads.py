"""The decode step a FULL CUDA graph captures reads nothing back to the host: the runner's graph body (the model over
the persistent buffers with the attention backend's fixed-buffer decode) compiled with fullgraph=True and a backend
that fails on any data-dependent value or host copy (tests/host_reads.py), for a dense model, a MoE model, and a MoE
model with expert parallel over two gloo ranks in lock-step DP (the fixed-capacity exchange inside the graph, beside
an idle rank's dummy batch). Each 'replay' runs the compiled body, and the tokens equal the eager runner's.

The compiled path is the CUDA one: raylm's CPU kernels are off (custom_ops="none"), and under torch.compile no CPU
fast path that reads values is taken (runner/host_sync.py). MoE models run in bfloat16, the dtype of the experts'
one-kernel grouped matmul (its meta function refuses others)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from raylm.common.outputs import SchedulerOutput
from raylm.runner.model_runner import ModelRunner
from raylm.runner.parallel_state import destroy_model_parallel, init_distributed_environment, init_model_parallel
from tests.host_reads import compile_without_host_reads
from tests.runner_steps import Steps, make_runner, model_parallel_of_one, run_step
from tests.test_dp_utils import run_two_ranks

SIZES = [4]
SETTINGS = dict(cudagraph_capture_sizes=SIZES, custom_ops="none", attention_backend="torch")
PROMPTS = {"a": [5, 17, 33, 2, 101, 64, 7], "b": [9, 8, 7], "c": [40, 41, 42, 43, 44]}


class CompiledGraphs:
    """Stands in for CUDAGraphRunner on CPU: each size's 'graph' is the runner's graph body compiled without host
    reads (what capture would record), run on the persistent buffers at replay."""

    def __init__(self, runner: ModelRunner) -> None:
        assert runner.model is not None and runner.graphs is not None
        model, graphs = runner.model, runner.graphs
        self.body, self.backend = compile_without_host_reads(lambda n: graphs.forward(model, n))
        self.replayed: list[int] = []

    def has(self, num_tokens: int) -> bool:
        return num_tokens in SIZES

    def replay(self, num_tokens: int) -> torch.Tensor:
        self.replayed.append(num_tokens)
        return self.body(num_tokens)


def serve(runner: ModelRunner, schedule: list[tuple[dict[str, list[int]] | None, dict[str, int] | None]]
          ) -> list[dict[str, list[int]]]:
    steps, tokens = Steps(runner.block_size), []
    for prompts, decodes in schedule:
        if prompts is None and decodes is None:
            runner.execute_model(SchedulerOutput.empty())  # an idle DP rank: a dummy batch
            continue
        tokens.append(run_step(runner, steps.schedule(prompts, decodes))[0])
    return tokens


def compiled_and_eager(model: Path, schedule: list[Any], **settings: Any) -> tuple[list[Any], list[Any], list[int]]:
    runner = make_runner(model, **SETTINGS, **settings)
    graphs = CompiledGraphs(runner)
    runner.graphs.runner = graphs  # type: ignore[assignment, union-attr]
    compiled = serve(runner, schedule)
    assert graphs.backend.num_graphs >= 1  # the compiled body ran, not an eager fallback
    eager = serve(make_runner(model, **{**SETTINGS, "cudagraph_capture_sizes": None}, **settings), schedule)
    return compiled, eager, graphs.replayed


DECODES = [(PROMPTS, None)] + [(None, dict.fromkeys(PROMPTS, 1))] * 3


@pytest.mark.usefixtures(model_parallel_of_one.__name__)
def test_dense_decode_step_compiles_without_host_reads(llama_path: Path) -> None:
    compiled, eager, replayed = compiled_and_eager(llama_path, DECODES)
    assert compiled == eager and replayed == [4, 4, 4]


@pytest.mark.usefixtures(model_parallel_of_one.__name__)
def test_moe_decode_step_compiles_without_host_reads(moe_checkpoints: dict[str, Path]) -> None:
    compiled, eager, replayed = compiled_and_eager(moe_checkpoints["mixtral"], DECODES, dtype="bfloat16")
    assert compiled == eager and replayed == [4, 4, 4]


# Rank 0 decodes three requests, rank 1 one, then rank 1 is idle (its dummy batches run eagerly, through the same
# fixed-capacity exchange as rank 0's compiled graph).
EP_SCHEDULES = [
    [(PROMPTS, None)] + [(None, dict.fromkeys(PROMPTS, 1))] * 4,
    [({"d": [50, 51, 52, 53]}, None), (None, {"d": 1}), (None, {"d": 1}), (None, None), (None, None)],
]


def _ep_rank(rank: int, store: str, model: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_distributed_environment(2, rank, f"file://{store}", "gloo")
    init_model_parallel(tp_size=1, pp_size=1, dp_size=2, enable_expert_parallel=True)
    compiled, eager, replayed = compiled_and_eager(Path(model), EP_SCHEDULES[rank], dtype="bfloat16",
                                                   data_parallel_size=2, enable_expert_parallel=True)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(dict(same=compiled == eager, replayed=replayed)))
    destroy_model_parallel()
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_expert_parallel_decode_step_compiles_without_host_reads(moe_checkpoints: dict[str, Path],
                                                                 tmp_path: Path) -> None:
    run_two_ranks(_ep_rank, str(tmp_path / "store"), str(moe_checkpoints["mixtral"]), str(tmp_path), timeout_s=600)
    busy, idle = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2))
    assert busy == {"same": True, "replayed": [4, 4, 4, 4]}
    assert idle == {"same": True, "replayed": [4, 4]}
