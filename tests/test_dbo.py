"""Dual batch overlap at DP=2 with expert parallel. Two ModelRunner processes over gloo: micro-batched steps give the
tokens and logits of unsliced ones, a step where one rank would have an empty ubatch is not sliced, and ranks that
disagree (one wants micro-batches, one does not) both run unsliced. Then whole engines (Ray, lock-step DP): with
micro-batches on every step they can be (thresholds of 1), and with every batch padded too, tiny Mixtral and Qwen3-MoE
are token-exact with transformers and with one device, and so is DP=2 x TP=2."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from raylm.cluster import LLM
from raylm.runner.parallel_state import destroy_model_parallel, init_distributed_environment, init_model_parallel
from tests.reference import assert_same_output, check_logprobs_close, hf_greedy
from tests.runner_steps import Steps, make_runner, run_step
from tests.test_dp_expert_parallel import ENGINE, MAX_TOKENS, Result, generate, make_prompts
from tests.test_dp_utils import run_two_ranks

pytestmark = pytest.mark.slow
DBO = dict(enable_dbo=True, dbo_decode_token_threshold=1, dbo_prefill_token_threshold=1)
# Capture sizes that (almost) never equal a batch: nearly every forward is padded, on CPU run eagerly.
PADDING = dict(cudagraph_capture_sizes=[3, 7, 19, 61, 127])
LOCKSTEP = dict(data_parallel_size=2, enable_expert_parallel=True)

# Per rank, per step: new prompts and decodes. Step 3: rank 0 has 3 tokens, rank 1 has 19; the cut at 9 of the padded
# 19 would leave rank 0's last ubatch empty, so nobody slices. Elsewhere both ranks have enough tokens to slice.
SCHEDULES = [
    [({"a": [5, 17, 33, 2, 101, 64, 7, 8, 9], "b": [40, 41, 42, 43, 44]}, None), (None, {"a": 1, "b": 1}),
     (None, {"a": 1, "b": 1}), ({"e": [3]}, {"a": 1, "b": 1}), (None, {"a": 1, "b": 1, "e": 1})],
    [({"c": [50, 51, 52, 53], "d": [60 + i for i in range(12)]}, None), (None, {"c": 1, "d": 1}),
     (None, {"c": 1, "d": 1}), ({"f": [70 + i for i in range(17)]}, {"c": 1, "d": 1}),
     (None, {"c": 1, "d": 1, "f": 1})],
]


def _serve(rank: int, model: str, settings: dict[str, Any]) -> dict[str, Any]:
    runner = make_runner(model, **LOCKSTEP, record_forwards=True, **settings)
    decisions: list[bool] = []
    assert runner.planner is not None
    decide = runner.planner.determine_batch_execution_and_padding

    def record(*args: Any) -> Any:
        descriptor = decide(*args)
        decisions.append(descriptor.should_ubatch)
        return descriptor

    runner.planner.determine_batch_execution_and_padding = record  # type: ignore[method-assign]
    steps = Steps(runner.block_size)
    tokens, logits = [], []
    for prompts, decodes in SCHEDULES[rank]:
        sampled, step_logits = run_step(runner, steps.schedule(prompts, decodes))
        tokens.append(sampled)
        logits.append(step_logits.tolist())
    return dict(tokens=tokens, logits=logits, should_ubatch=decisions, forwards=runner.forward_log.counts.forwards,
                coordinations=runner.planner.dp_group.num_cpu_all_reduces, ubatched=runner.forward_log.counts.ubatched)


def _two_runners(rank: int, store: str, model: str, out_dir: str, rank_settings: str) -> None:
    torch.set_num_threads(1)
    init_distributed_environment(2, rank, f"file://{store}", "gloo")
    init_model_parallel(tp_size=1, pp_size=1, dp_size=2, enable_expert_parallel=True)
    # Each rank serves its schedule with its own settings, then again without micro-batches (the reference).
    results = [_serve(rank, model, json.loads(rank_settings)[rank]), _serve(rank, model, {})]
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))
    destroy_model_parallel()
    torch.distributed.destroy_process_group()


def run_runners(tmp_path: Path, model: Path, settings: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    run_two_ranks(_two_runners, str(tmp_path / "store"), str(model), str(tmp_path), json.dumps(settings),
                  timeout_s=240)
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_ubatched_runners_match_unsliced(arch: str, moe_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    for sliced, reference in run_runners(tmp_path, moe_checkpoints[arch], [{**DBO, **PADDING}] * 2):
        assert sliced["should_ubatch"] == [True, True, True, False, True]
        assert sliced["ubatched"] == 4 and reference["ubatched"] == 0
        assert sliced["forwards"] == sliced["coordinations"] == reference["forwards"] == 5
        assert sliced["tokens"] == reference["tokens"]
        for ours, theirs in zip(sliced["logits"], reference["logits"]):
            torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), atol=1e-5, rtol=1e-5)


def test_ranks_that_disagree_run_unsliced(moe_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    reluctant = {**DBO, "dbo_decode_token_threshold": 1000, "dbo_prefill_token_threshold": 1000}
    for sliced, reference in run_runners(tmp_path, moe_checkpoints["mixtral"], [DBO, reluctant]):
        assert sliced["should_ubatch"] == [False] * 5 and sliced["ubatched"] == 0
        assert sliced["tokens"] == reference["tokens"]


# ---- whole engines ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def references(moe_checkpoints: dict[str, Path]) -> dict[str, tuple[Result, Result]]:
    """Per arch: transformers' greedy output and one device's."""
    results = {}
    for arch, path in moe_checkpoints.items():
        llm = LLM(model=str(path), **ENGINE)
        results[arch] = (hf_greedy(path, make_prompts(), MAX_TOKENS), generate(llm, make_prompts()))
        llm.shutdown()
    return results


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("arch, settings", [("mixtral", DBO), ("qwen3_moe", {**DBO, **PADDING})],
                         ids=["mixtral-dbo", "qwen3_moe-dbo-padded"])
def test_dp2_ep_engines_match_transformers(arch: str, settings: dict[str, Any], moe_checkpoints: dict[str, Path],
                                           references: dict[str, tuple[Result, Result]]) -> None:
    """Each arch and each batch shape once, on whole engines; with the runner tests above, every pair:

    | arch      | DBO, unpadded                   | DBO, padded                           |
    |-----------|---------------------------------|---------------------------------------|
    | mixtral   | here                            | test_ubatched_runners_match_unsliced  |
    | qwen3_moe | test_dp2_by_tp2_ep_with_dbo_... | here                                  |
    """
    llm = LLM(model=str(moe_checkpoints[arch]), **LOCKSTEP, **settings, **ENGINE)
    try:
        ours = generate(llm, make_prompts())
        counts = llm.collective_rpc("batch_execution_counts")
    finally:
        llm.shutdown()
    hf, one_device = references[arch]
    assert check_logprobs_close(hf, ours, f"{arch} dp2 ep {sorted(settings)}") <= 1
    assert_same_output(ours, one_device)
    assert all(count["ubatched"] > 0 for count in counts), counts
    if "cudagraph_capture_sizes" in settings:  # decode batches padded to a capture size, on some rank
        assert any(count["padded"] > 0 for count in counts), counts


@pytest.mark.usefixtures("ray_cluster")
def test_dp2_by_tp2_ep_with_dbo_matches_one_device(moe_checkpoints: dict[str, Path],
                                                  references: dict[str, tuple[Result, Result]]) -> None:
    """Inside each ubatch thread the TP ranks all-gather their token slices (a blocking collective on the TP group)
    while the other ubatch's expert all_to_all may be in flight on the EP group."""
    llm = LLM(model=str(moe_checkpoints["qwen3_moe"]), tensor_parallel_size=2, **LOCKSTEP, **DBO, **ENGINE)
    try:
        ours = generate(llm, make_prompts())
        counts = llm.collective_rpc("batch_execution_counts")
    finally:
        llm.shutdown()
    assert_same_output(ours, references["qwen3_moe"][1])
    assert len(counts) == 4 and all(count["ubatched"] > 0 for count in counts), counts
