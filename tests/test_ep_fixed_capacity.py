"""Expert parallel through fixed-capacity buffers (distributed/fixed_capacity.py) against the variable-size exchange,
over gloo: dispatch / combine on uneven and empty loads give the same sums and send each token once per destination
rank; and lock-step DP=2 x EP ModelRunners whose decode steps are planned as FULL graphs (fixed capacity) sample the
tokens of runners that decode eagerly (variable size), with uneven loads and an idle rank running dummy batches."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from raylm.common.outputs import SchedulerOutput
from raylm.runner.batch_descriptor import BatchDescriptor, CUDAGraphMode
from raylm.runner.distributed import get_all2all_manager
from raylm.runner.distributed.fixed_capacity import FixedCapacityAll2All, dispatch_capacity
from raylm.runner.forward_context import set_forward_context
from raylm.runner.layers.fused_moe import FusedMoE
from raylm.runner.parallel_state import (
    destroy_model_parallel,
    get_ep_group,
    init_distributed_environment,
    init_model_parallel,
)
from tests.runner_steps import Steps, make_runner, run_step
from tests.test_dp_utils import run_two_ranks

pytestmark = pytest.mark.slow
LOCKSTEP = dict(data_parallel_size=2, enable_expert_parallel=True)
# Decode batches padded to 4 or 8 and planned FULL (on CPU: run eagerly, through the fixed-capacity exchange).
GRAPHS = dict(cudagraph_capture_sizes=[4, 8])


def _scaled_by_expert(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return sum(weights[:, j:j + 1] * x * (ids[:, j:j + 1] + 1) for j in range(ids.shape[1]))


def _exchanges(rank: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_distributed_environment(2, rank, f"file://{store}", "gloo")
    init_model_parallel(tp_size=1, dp_size=2, enable_expert_parallel=True)
    group = get_ep_group()
    variable, fixed = get_all2all_manager(group, num_experts=6), FixedCapacityAll2All(group, num_experts=6, top_k=3)
    assert fixed.experts_per_rank == 3
    gen = torch.Generator().manual_seed(0)
    # (tokens of rank 0, of rank 1, highest expert id): uneven, one side empty, all to rank 0's experts, nothing.
    for sizes, max_expert in [((7, 2), 6), ((5, 0), 6), ((0, 3), 6), ((4, 6), 3), ((0, 0), 6)]:
        inputs = [(torch.randn(n, 8, generator=gen), torch.rand(n, max_expert, generator=gen).argsort(dim=1)[:, :3],
                   torch.rand(n, 3, generator=gen)) for n in sizes]
        x, ids, weights = inputs[rank]
        rows, local_ids, handle = variable.dispatch(x, ids, weights)
        expected = variable.combine(rows * (local_ids + 1 + 3 * rank)[:, None], handle)
        capacity = max(max(sizes), 1)
        rows, experts, fixed_handle = fixed.dispatch(x, ids, weights, capacity)
        assert rows.shape == (2 * capacity, 8) and experts.shape == (2 * capacity, 3)
        # One send per (token, destination rank), whatever the number of its experts there.
        assert fixed_handle.send_counts.tolist() == [int(((ids // 3) == r).any(1).sum()) for r in range(2)]
        assert int((experts >= 0).sum()) == sum(int(((i // 3) == rank).sum()) for _, i, _ in inputs)
        outputs = torch.where(experts[..., None] >= 0, rows[:, None, :] * (experts + 1 + 3 * rank)[..., None], 0)
        combined = fixed.combine(outputs.flatten(0, 1), fixed_handle)
        assert torch.equal(combined, expected)
        torch.testing.assert_close(combined, _scaled_by_expert(x, ids, weights))

    # FusedMoE in a forward planned FULL (fixed capacity) against one planned eager (variable size).
    moe = FusedMoE(6, 2, 8, 12, renormalize=True)
    moe.w13_weight.data.normal_(0, 0.5, generator=gen)
    moe.w2_weight.data.normal_(0, 0.5, generator=gen)
    for tokens in [(1, 3), (4, 4), (2, 1)]:
        n = tokens[rank]
        x, logits = torch.randn(n, 8, generator=gen), torch.randn(n, 6, generator=gen)
        eager = BatchDescriptor(n, n, n, True, CUDAGraphMode.NONE, num_tokens_across_dp=list(tokens))
        full = BatchDescriptor(n, max(tokens), n, True, CUDAGraphMode.FULL, num_tokens_across_dp=list(tokens))
        with set_forward_context(None, n, eager):
            assert dispatch_capacity(n, 1) is None
            expected = moe(x, logits)
        with set_forward_context(None, max(tokens), full):
            assert dispatch_capacity(n, 1) == max(tokens)
            assert torch.equal(moe(x, logits), expected)
    (Path(out_dir) / f"rank{rank}").touch()
    destroy_model_parallel()
    torch.distributed.destroy_process_group()


def test_fixed_capacity_exchange_equals_the_variable_one(tmp_path: Path) -> None:
    run_two_ranks(_exchanges, str(tmp_path / "store"), str(tmp_path), timeout_s=120)
    assert sorted(p.name for p in tmp_path.glob("rank*")) == ["rank0", "rank1"]


# Per rank, per step: new prompts and decodes (None: an empty step, an idle rank's dummy batch). Rank 0 decodes three
# requests while rank 1 decodes one, then rank 1 is idle for three steps; step 2 mixes a prefill in (eager for all).
SCHEDULES = [
    [({"a": [5, 17, 33, 2, 101, 64, 7, 8, 9], "b": [40, 41, 42, 43, 44]}, None), (None, {"a": 1, "b": 1}),
     ({"e": [3, 4, 5]}, {"a": 1, "b": 1}), (None, {"a": 1, "b": 1, "e": 1}), (None, {"a": 1, "b": 1, "e": 1}),
     (None, {"a": 1}), (None, {"a": 1, "e": 1})],
    [({"c": [50, 51, 52, 53]}, None), (None, {"c": 1}), ({"d": [60 + i for i in range(12)]}, {"c": 1}),
     (None, {"c": 1, "d": 1}), (None, None), (None, None), (None, None)],
]


def _serve(rank: int, model: str, settings: dict[str, Any]) -> dict[str, Any]:
    runner = make_runner(model, **LOCKSTEP, record_forwards=True, **settings)
    calls = {"fixed": 0, "variable": 0}
    for name, manager in (("fixed", runner_manager(runner, "fixed_all2all")),
                          ("variable", runner_manager(runner, "all2all"))):
        dispatch = manager.dispatch

        def counted(*args: Any, name: str = name, dispatch: Any = dispatch) -> Any:
            calls[name] += 1
            return dispatch(*args)

        manager.dispatch = counted
    steps = Steps(runner.block_size)
    tokens, logits = [], []
    for prompts, decodes in SCHEDULES[rank]:
        if prompts is None and decodes is None:
            assert runner.execute_model(SchedulerOutput.empty()).req_ids == []  # a dummy batch joins the others
            continue
        sampled, step_logits = run_step(runner, steps.schedule(prompts, decodes))
        tokens.append(sampled)
        logits.append(step_logits.tolist())
    return dict(tokens=tokens, logits=logits, calls=calls, forwards=runner.forward_log.counts.forwards)


def runner_manager(runner: Any, name: str) -> Any:
    """The first MoE layer's manager `name` (every layer's is its own object)."""
    moe = next(m for m in runner.model.modules() if isinstance(m, FusedMoE))
    return getattr(moe, name)


def _two_runners(rank: int, store: str, model: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_distributed_environment(2, rank, f"file://{store}", "gloo")
    init_model_parallel(tp_size=1, pp_size=1, dp_size=2, enable_expert_parallel=True)
    results = [_serve(rank, model, GRAPHS), _serve(rank, model, {})]
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))
    destroy_model_parallel()
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_dp2_ep_decodes_through_fixed_capacity_sample_the_same(arch: str, moe_checkpoints: dict[str, Path],
                                                               tmp_path: Path) -> None:
    run_two_ranks(_two_runners, str(tmp_path / "store"), str(moe_checkpoints[arch]), str(tmp_path), timeout_s=240)
    busy, idle = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2))
    for fixed, variable in (busy, idle):
        assert fixed["tokens"] == variable["tokens"]
        for ours, theirs in zip(fixed["logits"], variable["logits"]):
            torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), atol=1e-5, rtol=1e-5)
        assert fixed["forwards"] == variable["forwards"] == 7
        assert variable["calls"] == {"fixed": 0, "variable": 7}
    # Steps 0 and 2 hold a prefill (variable size everywhere); the five others are planned FULL on both ranks, the
    # idle rank's three dummy batches included.
    assert busy[0]["calls"] == idle[0]["calls"] == {"fixed": 5, "variable": 2}
