"""The forward log is a diagnostic behind `record_forwards`: off by default, nothing is recorded or counted in the hot
path (no hook on the model, no counter in the runner); on, every forward's graph key comes back in the workers'
cuda_graph_report and the forwards are counted (forward_counts, batch_execution_counts)."""
from __future__ import annotations

from pathlib import Path

import pytest

from raylm import LLM, SamplingParams
from tests.runner_steps import Steps, make_runner, model_parallel_of_one, run_step


def test_forwards_recorded_only_when_asked(llama_path: Path) -> None:
    params = SamplingParams(max_tokens=3, temperature=0.0)
    for record in (False, True):
        llm = LLM(model=str(llama_path), max_model_len=128, num_gpu_blocks_override=32, record_forwards=record)
        try:
            llm.generate([{"prompt_token_ids": [1, 5, 9]}], params, use_tqdm=False)
            forwards = llm.collective_rpc("cuda_graph_report")[0]["forwards"]
            if record:
                (num_forwards, _), = llm.collective_rpc("forward_counts")
            else:
                with pytest.raises(ValueError, match="forward_counts: forwards are counted only with "
                                                     "record_forwards=True"):
                    llm.collective_rpc("forward_counts")
        finally:
            llm.shutdown()
        if record:
            assert len(forwards) >= 3 and all(forward["key"].startswith("NONE/") for forward in forwards)
            assert num_forwards >= len(forwards)  # the counts outlive cuda_graph_report's drain
        else:
            assert forwards == []


@pytest.mark.usefixtures(model_parallel_of_one.__name__)
def test_forwards_counted_only_when_asked(llama_path: Path) -> None:
    """Off: the model runs without a forward hook and the runner holds no counter; on: each forward counts once,
    the padded ones apart, and draining the log keeps the counts."""
    for record in (False, True):
        runner = make_runner(llama_path, cudagraph_capture_sizes=[4], record_forwards=record)
        assert runner.model is not None
        assert not runner.model._forward_pre_hooks and not runner.model._forward_hooks
        steps = Steps(runner.block_size)
        run_step(runner, steps.schedule({"a": [5, 6, 7], "b": [3, 4]}))  # 5 tokens, past the capture size: unpadded
        run_step(runner, steps.schedule(decodes={"a": 1, "b": 1}))  # 2 decodes, padded to 4
        run_step(runner, steps.schedule(decodes={"a": 1, "b": 1}))
        if not record:
            assert runner.forward_log is None
            continue
        assert runner.forward_log is not None
        assert len(runner.forward_log.drain()) == 3
        counts = runner.forward_log.counts
        assert (counts.forwards, counts.padded, counts.ubatched) == (3, 2, 0)
