"""Lock-step data parallel: the batch decision the DP ranks agree on, its all-reduce over gloo, and the ModelRunner's
forwards (real, dummy, padded) that all go through it."""
from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from raylm.common.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from raylm.common.sampling_params import SamplingParams
from raylm.runner.batch_descriptor import BatchDescriptor, CUDAGraphMode
from raylm.runner.dp_utils import (
    DPBatchDecision,
    coordinate_batch_across_dp,
    is_last_ubatch_empty,
    synchronize_dp_ranks,
)
from raylm.runner.forward_context import get_forward_context
from raylm.runner.model_runner import ModelRunner
from raylm.runner.parallel_state import (
    destroy_model_parallel,
    get_dp_group,
    init_distributed_environment,
    init_model_parallel,
)
from tests.runner_steps import resolved_config

NONE, PIECEWISE, FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL
PROMPT = [5, 17, 33, 2, 101, 64, 7]


# ---- the decision, without torch.distributed ------------------------------------------------------------------

def test_captured_graphs_pad_every_rank_to_the_max() -> None:
    decision = synchronize_dp_ranks([5, 13], [8, 16], [False, False], [FULL, PIECEWISE])
    assert decision == DPBatchDecision(False, [16, 16], PIECEWISE)


def test_eager_without_ubatch_is_not_padded() -> None:
    decision = synchronize_dp_ranks([5, 13, 1], [8, 16, 1], [True, True, False], [FULL, NONE, FULL])
    assert decision == DPBatchDecision(False, [8, 16, 1], NONE)  # one rank at NONE: all NONE


def test_ubatch_is_unanimous_and_forces_padding() -> None:
    assert synchronize_dp_ranks([70, 100], [70, 100], [True, True], [NONE, NONE]) == DPBatchDecision(
        True, [100, 100], NONE)
    assert not synchronize_dp_ranks([70, 100], [70, 100], [True, False], [NONE, NONE]).should_ubatch


def test_ubatch_vetoed_when_the_last_would_be_padding_only() -> None:
    # Padded to 128, the second ubatch starts at token 64: the rank with 40 real tokens would run it on padding.
    assert not synchronize_dp_ranks([40, 128], [48, 128], [True, True], [FULL, FULL]).should_ubatch
    assert synchronize_dp_ranks([65, 128], [72, 128], [True, True], [FULL, FULL]).should_ubatch


@pytest.mark.parametrize(("unpadded", "padded", "empty"), [(4, 8, True), (5, 8, False), (4, 9, True), (5, 9, False),
                                                           (1, 2, True), (2, 2, False), (1, 3, True), (2, 3, False)])
def test_is_last_ubatch_empty(unpadded: int, padded: int, empty: bool) -> None:
    assert is_last_ubatch_empty(unpadded, padded) == empty


# ---- the all-reduce over gloo ---------------------------------------------------------------------------------

def _init_dp2(rank: int, store: str) -> None:
    torch.set_num_threads(1)
    init_distributed_environment(2, rank, f"file://{store}", "gloo")
    init_model_parallel(tp_size=1, pp_size=1, dp_size=2)


def _shutdown() -> None:
    destroy_model_parallel()
    torch.distributed.destroy_process_group()


def run_two_ranks(fn: Callable[..., None], *args: str, timeout_s: float = 60.0) -> None:
    """fn(rank, *args) in two spawned processes. A rank that misses a collective leaves the other waiting: fail
    instead of hanging the suite."""
    context = mp.start_processes(fn, args=args, nprocs=2, start_method="spawn", join=False)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the DP ranks did not finish in {timeout_s} s: one waits in a collective the other skipped")


def _coordinate(rank: int, store: str, out_dir: str) -> None:
    _init_dp2(rank, store)
    # Rank 0: 5 tokens padded to 8, FULL graphs, wants micro-batches; rank 1: 30 tokens, PIECEWISE, does not.
    mine = [(5, 8, True, FULL), (30, 32, False, PIECEWISE)][rank]
    decisions = [coordinate_batch_across_dp(*mine, dp_group=get_dp_group()) for _ in range(2)]
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps([dataclasses.asdict(d) for d in decisions]))
    _shutdown()


def test_coordinate_batch_across_dp_over_gloo(tmp_path: Path) -> None:
    run_two_ranks(_coordinate, str(tmp_path / "store"), str(tmp_path))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    expected = dataclasses.asdict(DPBatchDecision(False, [32, 32], PIECEWISE))
    assert results[0] == results[1] == [expected, expected]


# ---- the ModelRunner ------------------------------------------------------------------------------------------

def make_runner(model: str, lockstep: bool = False) -> ModelRunner:
    """`lockstep`: the resolved config says the DP ranks step together (as resolution decides for MoE with expert
    parallel over DP), here on a dense model so that its tokens are easy to check."""
    config = resolved_config(model=model, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                             record_forwards=True)
    if lockstep:
        config = dataclasses.replace(config, resolution=dataclasses.replace(config.resolved, dp_lockstep=True))
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(num_blocks=16)
    return runner


def prefill(req_id: str, prompt: list[int], blocks: list[int]) -> SchedulerOutput:
    new = NewRequestData(req_id, prompt, [], SamplingParams(temperature=0.0, seed=0), blocks, 0)
    return SchedulerOutput([new], CachedRequestData(), {req_id: len(prompt)}, len(prompt), set())


def decode(req_id: str, num_computed: int) -> SchedulerOutput:
    cached = CachedRequestData([req_id], [[]], [num_computed], [[]])
    return SchedulerOutput([], cached, {req_id: 1}, 1, set())


def step(runner: ModelRunner, index: int, tokens: list[int], logits: list[torch.Tensor]) -> None:
    """Step `index` of request "a" (PROMPT in blocks 0-3, then greedy decodes): its logits and token appended."""
    out = prefill("a", PROMPT, [0, 1, 2, 3]) if index == 0 else decode("a", len(PROMPT) + index - 1)
    assert runner.execute_model(out) is None
    assert runner.execute_model_state is not None
    logits.append(runner.execute_model_state.logits.clone())
    tokens += runner.sample_tokens().sampled_token_ids[0]


def generate(runner: ModelRunner, num_decodes: int) -> tuple[list[int], list[torch.Tensor]]:
    tokens: list[int] = []
    logits: list[torch.Tensor] = []
    for index in range(num_decodes + 1):
        step(runner, index, tokens, logits)
    return tokens, logits


@pytest.fixture
def model_parallel_of_one() -> None:
    init_model_parallel(1, 1)


@pytest.mark.usefixtures("model_parallel_of_one")
def test_dummy_batch_is_one_forward_that_changes_nothing(llama_path: Path) -> None:
    expected_tokens, expected_logits = generate(make_runner(str(llama_path)), num_decodes=4)
    runner = make_runner(str(llama_path))
    tokens, logits = generate(runner, num_decodes=1)
    batch = runner.input_batch
    before = (list(batch.req_ids), batch.num_tokens.copy(), batch.token_ids_cpu.copy(),
              batch.num_computed_tokens_cpu.copy(), [c.clone() for c in runner.kv_caches])
    num_forwards = runner.forward_log.counts.forwards
    runner.execute_dummy_batch()
    assert runner.forward_log.counts.forwards == num_forwards + 1
    assert get_dp_group().num_cpu_all_reduces == 0  # a DP world of one coordinates nothing
    assert runner.execute_model_state is None
    after = (list(batch.req_ids), batch.num_tokens, batch.token_ids_cpu, batch.num_computed_tokens_cpu,
             runner.kv_caches)
    assert before[0] == after[0]
    for old, new in zip(before[1:4], after[1:4]):
        assert (old == new).all()
    assert all(torch.equal(old, new) for old, new in zip(before[4], after[4]))

    # The request goes on as if no dummy batch had run; an empty step runs no forward at all.
    num_forwards = runner.forward_log.counts.forwards
    assert runner.execute_model(SchedulerOutput.empty()).req_ids == []
    assert runner.forward_log.counts.forwards == num_forwards
    for index in range(2, 5):
        step(runner, index, tokens, logits)
        runner.execute_dummy_batch()
    assert tokens == expected_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, expected_logits))


@pytest.mark.usefixtures("model_parallel_of_one")
def test_padded_forward_samples_the_same(llama_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What DP padding will do once graphs are captured: extra rows after the real tokens, never sampled, no KV
    written for them."""
    expected_tokens, expected_logits = generate(make_runner(str(llama_path)), num_decodes=3)
    runner = make_runner(str(llama_path))
    assert runner.planner is not None
    decide = runner.planner.determine_batch_execution_and_padding
    seen: list[BatchDescriptor] = []

    def pad_by_three(num_tokens: int, num_reqs: int, uniform_decode: bool, has_lora: bool) -> BatchDescriptor:
        descriptor = dataclasses.replace(decide(num_tokens, num_reqs, uniform_decode, has_lora),
                                         num_tokens_padded=num_tokens + 3)
        seen.append(descriptor)
        return descriptor

    monkeypatch.setattr(runner.planner, "determine_batch_execution_and_padding", pad_by_three)
    tokens, logits = generate(runner, num_decodes=3)
    assert [d.num_tokens for d in seen] == [len(PROMPT), 1, 1, 1]
    assert [d.uniform_decode for d in seen] == [False, True, True, True]
    assert runner.buffers.slot_mapping.np[1:4].tolist() == [-1, -1, -1]  # the last step's padding rows
    assert tokens == expected_tokens
    for ours, reference in zip(logits, expected_logits):
        torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


def _dp_runner(rank: int, store: str, model: str, out_dir: str) -> None:
    """Rank 0 serves a request for three steps; rank 1 is idle: two dummy batches and one empty step."""
    _init_dp2(rank, store)
    runner = make_runner(model, lockstep=True)
    descriptors: list[list[int] | None] = []
    assert runner.model is not None
    runner.model.register_forward_pre_hook(
        lambda module, args: descriptors.append(get_forward_context().batch_descriptor.num_tokens_across_dp))
    if rank == 0:
        tokens, _ = generate(runner, num_decodes=2)
    else:
        tokens = []
        runner.execute_dummy_batch()
        assert runner.execute_model(SchedulerOutput.empty()).req_ids == []
        runner.execute_dummy_batch()
    result = dict(tokens=tokens, descriptors=descriptors, forwards=runner.forward_log.counts.forwards,
                  coordinations=get_dp_group().num_cpu_all_reduces)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    _shutdown()


@pytest.mark.slow
def test_idle_dp_rank_joins_every_forward(llama_path: Path, tmp_path: Path) -> None:
    run_two_ranks(_dp_runner, str(tmp_path / "store"), str(llama_path), str(tmp_path))
    busy, idle = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert busy["forwards"] == busy["coordinations"] == idle["forwards"] == idle["coordinations"] == 3
    # Eager and no micro-batches: each rank runs its own size, and both know both sizes.
    assert busy["descriptors"] == idle["descriptors"] == [[len(PROMPT), 1], [1, 1], [1, 1]]
    assert len(busy["tokens"]) == 3
