"""The CUDA-graph plan resolution decides (configs/cudagraph_plan.py: capture sizes, rounding, enforce_eager, custom
sizes, CPU default, models without FULL graphs), the dispatcher that follows it (FULL only for uniform decode), the
settings that feed them, and the ModelRunner's batch decision on real steps: uniform decode detected, padding
applied, the trace line logged."""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest

from raylm.configs import make_engine_config
from raylm.configs.cudagraph_plan import default_capture_sizes, plan_cuda_graphs
from raylm.runner.attention import CPUAttentionBackend
from raylm.runner.batch_descriptor import CUDAGraphMode
from raylm.runner.cudagraph_dispatcher import CudagraphDispatcher
from tests.runner_steps import Steps, make_runner, model_parallel_of_one, run_step

NONE, FULL = CUDAGraphMode.NONE, CUDAGraphMode.FULL


def dispatcher(device: str = "cpu", why_no_full: str | None = None, query_len: int = 1,
               **settings: Any) -> CudagraphDispatcher:
    config = make_engine_config(**settings)
    return CudagraphDispatcher(plan_cuda_graphs(config.compilation_config, config.scheduler_config, device, query_len,
                                                why_no_full))


def test_default_capture_sizes_are_vllms() -> None:
    assert default_capture_sizes(3) == [1, 2]
    assert default_capture_sizes(128) == [1, 2, 4, *range(8, 129, 8)]
    sizes = default_capture_sizes(300)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-4:] == [248, 256, 272, 288]
    # max_num_seqs bounds the default; max_cudagraph_capture_size replaces that bound.
    assert dispatcher("cuda", max_num_seqs=20).capture_sizes == [1, 2, 4, 8, 16]
    assert dispatcher("cuda", max_num_seqs=64, max_cudagraph_capture_size=40).capture_sizes[-1] == 40
    # A uniform decode batch holds at most max_num_seqs requests: larger sizes are never captured.
    assert dispatcher("cuda", max_num_seqs=20, max_cudagraph_capture_size=40).capture_sizes[-1] == 16


def test_cuda_default_is_full_for_uniform_decode_only() -> None:
    d = dispatcher("cuda", max_num_seqs=128)
    assert d.mode_name == "FULL_DECODE_ONLY"
    assert d.dispatch(1, True) == (FULL, 1)
    assert d.dispatch(5, True) == (FULL, 8)  # rounded up to the nearest size
    assert d.dispatch(17, True) == (FULL, 24)
    assert d.dispatch(128, True) == (FULL, 128)
    assert d.dispatch(129, True) == (NONE, 129)  # past the largest size: eager, unpadded
    assert d.dispatch(5, False) == (NONE, 5)  # a batch with a prefill: eager
    assert d.full_capture_sizes == d.capture_sizes


def test_cpu_default_never_pads() -> None:
    d = dispatcher("cpu")
    assert d.mode_name == "NONE" and d.full_capture_sizes == []
    for num_tokens, uniform in [(1, True), (5, True), (7, False), (2048, False)]:
        assert d.dispatch(num_tokens, uniform) == (NONE, num_tokens)
    # Asking for sizes on CPU pads as on CUDA (and runs eagerly).
    assert dispatcher("cpu", cudagraph_capture_sizes=[4]).dispatch(3, True) == (FULL, 4)


@pytest.mark.parametrize("settings", [dict(enforce_eager=True), dict(enforce_eager=True, cudagraph_mode="FULL"),
                                      dict(cudagraph_mode="NONE")])
def test_eager_settings(settings: dict[str, Any]) -> None:
    d = dispatcher("cuda", **settings)
    assert d.mode_name == "NONE" and d.full_capture_sizes == []
    assert d.dispatch(3, True) == (NONE, 3) and d.dispatch(3, False) == (NONE, 3)


def test_custom_sizes_and_modes() -> None:
    d = dispatcher("cpu", cudagraph_capture_sizes=[10, 3, 3])
    assert d.capture_sizes == [3, 10]
    assert d.dispatch(1, True) == (FULL, 3)
    assert d.dispatch(4, False) == (NONE, 4)  # a mixed batch runs eagerly, unpadded
    assert d.dispatch(11, True) == (NONE, 11)
    # vLLM's FULL would capture mixed batches too: raylm's graphs are uniform-decode only, mixed batches run eagerly.
    assert dispatcher("cpu", cudagraph_capture_sizes=[4], cudagraph_mode="FULL").dispatch(2, False) == (NONE, 2)
    # Sizes past the step's token budget can never be used.
    assert dispatcher("cpu", cudagraph_capture_sizes=[4, 4096], max_num_batched_tokens=64).capture_sizes == [4]
    # A FULL graph of more requests than the batch holds: never captured, so eager instead.
    d = dispatcher("cpu", cudagraph_capture_sizes=[4, 16], max_num_seqs=8)
    assert d.dispatch(6, True) == (NONE, 6) and d.full_capture_sizes == [4]
    # Speculative decoding's k + 1 rows per request: sizes rounded up to whole requests, bounded by max_num_seqs.
    assert dispatcher("cuda", query_len=3, max_num_seqs=4).capture_sizes == [3, 6, 9]


def test_models_without_full_graphs() -> None:
    """Models that read back to the host mid-forward (MoE under expert parallel, pipeline stages): no FULL graphs,
    uniform decode batches run eagerly too."""
    d = dispatcher("cuda", why_no_full="pipeline stages exchange tensors between forwards")
    assert d.mode_name == "NONE"  # the mode in effect, which the engine-config line logs
    assert d.dispatch(3, True) == (NONE, 3) and d.full_capture_sizes == []


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL_AND_PIECEWISE"])
def test_piecewise_modes_are_refused_with_the_reason(mode: str) -> None:
    """raylm builds no piecewise graphs: the setting is refused instead of padding batches that then run eagerly."""
    with pytest.raises(ValueError, match=f"cudagraph_mode {mode}: .* piecewise graphs need torch.compile"):
        make_engine_config(cudagraph_mode=mode)


@pytest.mark.parametrize("settings, message", [
    (dict(enable_dbo=True), "enable_dbo needs data_parallel_size > 1 with enable_expert_parallel"),
    (dict(enable_dbo=True, data_parallel_size=2), "enable_expert_parallel=False"),
    (dict(enable_dbo=True, enable_expert_parallel=True), "data_parallel_size=1"),
    (dict(dbo_decode_token_threshold=0), "dbo_decode_token_threshold"),
    (dict(cudagraph_mode="SOMETIMES"), "cudagraph_mode"),
    (dict(cudagraph_capture_sizes=[0, 8]), "cudagraph_capture_sizes"),
    (dict(cudagraph_capture_sizes=[8, 16], max_cudagraph_capture_size=32), "max_cudagraph_capture_size (32)"),
])
def test_bad_settings_name_the_field(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        make_engine_config(**settings)


@pytest.mark.usefixtures(model_parallel_of_one.__name__)
def test_runner_detects_uniform_decode_and_pads(llama_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    runner = make_runner(llama_path, cudagraph_capture_sizes=[3, 8], log_batch_execution=True,
                         record_forwards=True)
    descriptors = []
    assert runner.planner is not None
    decide = runner.planner.determine_batch_execution_and_padding

    def record(*args: Any) -> Any:
        descriptors.append(decide(*args))
        return descriptors[-1]

    runner.planner.determine_batch_execution_and_padding = record  # type: ignore[method-assign]
    caplog.set_level(logging.INFO, logger="raylm.runner.batch_planner")
    steps = Steps()
    run_step(runner, steps.schedule({"a": [5, 6, 7, 8, 9], "b": [3, 4]}))  # 7 tokens, mixed: eager, unpadded
    run_step(runner, steps.schedule(decodes={"a": 1, "b": 1}))  # 2 decodes: FULL, padded to 3
    run_step(runner, steps.schedule({"c": [11, 12, 13]}, {"a": 1}))  # a decode beside a prefill: not uniform
    run_step(runner, steps.schedule({"d": [11] * 9}))  # past the largest size: eager, unpadded
    got = [(d.num_tokens, d.num_reqs, d.uniform_decode, d.cudagraph_mode, d.num_tokens_padded) for d in descriptors]
    assert got == [(7, 2, False, NONE, 7), (2, 2, True, FULL, 3), (4, 2, False, NONE, 4), (9, 1, False, NONE, 9)]
    assert runner.forward_log.counts.padded == 1
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("forward:")]
    assert lines[1] == ("forward: 2 tokens of 2 requests (uniform decode), padded to 3, cudagraph FULL, "
                        "ubatches none, DP tokens None")


@pytest.mark.usefixtures(model_parallel_of_one.__name__)
@pytest.mark.skipif(not CPUAttentionBackend.is_available(), reason="no CPU kernels")
def test_decode_graphs_follow_the_resolved_plan_only(llama_path: Path) -> None:
    """Whether the runner has FULL decode graphs, and so a scratch block past the scheduler's for their padding rows,
    is the resolved plan's (resolution turns FULL off where the backend cannot replay), whatever the backend: the
    cpu backend under a FULL plan reserves the block, the torch backend under NONE does not."""
    for backend, block_size, sizes, mode in (("cpu", 16, [4], "FULL_DECODE_ONLY"), ("torch", 4, None, "NONE")):
        runner = make_runner(llama_path, attention_backend=backend, block_size=block_size,
                             cudagraph_capture_sizes=sizes, record_forwards=True)
        assert runner.config.resolved.cudagraph.mode == mode and runner.graphs is not None
        full = mode != "NONE"
        assert runner.graphs.enabled == full
        assert runner.graphs.scratch_slot == (32 * block_size if full else -1)  # make_runner's 32 blocks
        assert runner.kv_caches[0].shape[1] == 32 + full
        steps = Steps(block_size)
        run_step(runner, steps.schedule({"a": [5, 6, 7], "b": [3, 4]}))
        tokens, _ = run_step(runner, steps.schedule(decodes={"a": 1, "b": 1}))  # padded to 4 under FULL
        assert runner.forward_log is not None and runner.forward_log.counts.padded == full
        assert sorted(tokens) == ["a", "b"]
