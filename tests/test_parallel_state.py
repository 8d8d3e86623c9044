"""Rank layout, pipeline layer split, and the process groups' collectives over gloo (4 processes)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from raylm.common.parallel_layout import RankLayout
from raylm.runner.models.utils import get_pp_indices
from raylm.runner.parallel_state import (
    destroy_model_parallel,
    get_dp_group,
    get_ep_group,
    get_pp_group,
    get_tp_group,
    init_distributed_environment,
    init_model_parallel,
)


def test_rank_layout_tp_innermost() -> None:
    """DP=2 x PP=2 x TP=2, the worked example of vLLM's initialize_model_parallel."""
    layout = RankLayout(tp_size=2, pp_size=2, dp_size=2)
    assert layout.world_size == 8
    assert layout.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.pp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert sorted(layout.dp_groups()) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.ep_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    for rank in range(8):
        dp, pp, tp = layout.coords(rank)
        assert layout.rank(dp, pp, tp) == rank == dp * 4 + pp * 2 + tp
    # Every rank is in exactly one group of each kind.
    for groups in (layout.tp_groups(), layout.pp_groups(), layout.dp_groups(), layout.ep_groups()):
        assert sorted(r for group in groups for r in group) == list(range(8))


@pytest.mark.parametrize(("tp", "pp", "output_rank"), [(1, 1, 0), (2, 1, 0), (1, 3, 2), (2, 2, 2), (4, 2, 4)])
def test_output_rank_is_first_tp_rank_of_last_stage(tp: int, pp: int, output_rank: int) -> None:
    layout = RankLayout(tp, pp)
    assert layout.output_rank() == output_rank
    assert layout.coords(output_rank) == (0, pp - 1, 0)


@pytest.mark.parametrize(("num_layers", "pp", "split"), [
    (5, 3, [(0, 2), (2, 4), (4, 5)]),  # spare layers before the last stage, from the second-to-last back
    (7, 4, [(0, 2), (2, 4), (4, 6), (6, 7)]),
    (6, 3, [(0, 2), (2, 4), (4, 6)]),
    (5, 2, [(0, 3), (3, 5)]),
])
def test_pp_layer_split(num_layers: int, pp: int, split: list[tuple[int, int]]) -> None:
    assert [get_pp_indices(num_layers, rank, pp) for rank in range(pp)] == split


def test_pp_layer_partition_override() -> None:
    assert [get_pp_indices(5, rank, 2, [4, 1]) for rank in range(2)] == [(0, 4), (4, 5)]
    with pytest.raises(ValueError, match="summing to 5"):
        get_pp_indices(5, 0, 2, [2, 2])


def _check_groups(rank: int, layout: RankLayout, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_distributed_environment(layout.world_size, rank, f"file://{store}", "gloo")
    init_model_parallel(layout.tp_size, layout.pp_size, layout.dp_size, enable_expert_parallel=True)
    dp, pp, tp = layout.coords(rank)
    for group, groups in [(get_tp_group(), layout.tp_groups()), (get_pp_group(), layout.pp_groups()),
                          (get_dp_group(), layout.dp_groups()), (get_ep_group(), layout.ep_groups())]:
        assert group.ranks in groups and group.rank == rank
        total = group.all_reduce(torch.tensor([float(rank)]))
        assert total.item() == sum(group.ranks), (group.ranks, total)
    gathered = get_tp_group().all_gather(torch.full((2, 1), float(rank)), dim=-1)
    assert gathered[0].tolist() == [float(r) for r in get_tp_group().ranks]
    if layout.dp_size == 1:  # EP is then the TP group itself: no second communicator
        assert get_ep_group().device_group is get_tp_group().device_group

    pp_group = get_pp_group()
    if pp_group.world_size > 1:
        data_ptrs = []
        for step, num_tokens in enumerate([5, 3, 9]):
            sent = {"hidden_states": torch.arange(num_tokens * 4, dtype=torch.float32).view(num_tokens, 4) + step,
                    "residual": torch.full((num_tokens, 4), float(tp)), "positions": torch.arange(num_tokens)}
            if pp_group.is_first_rank:
                pp_group.send_tensor_dict(sent)
            else:
                received = pp_group.recv_tensor_dict()
                assert list(received) == list(sent)
                for key in sent:
                    assert torch.equal(received[key], sent[key]), key
                data_ptrs.append(received["hidden_states"].data_ptr())
        if not pp_group.is_first_rank:
            assert data_ptrs[0] == data_ptrs[1] != data_ptrs[2]  # reused while it fits, grown when it does not
    (Path(out_dir) / f"rank{rank}").touch()
    destroy_model_parallel()
    torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("layout", [RankLayout(tp_size=2, pp_size=2), RankLayout(tp_size=2, dp_size=2)],
                         ids=["tp2_pp2", "tp2_dp2"])
def test_groups_over_gloo(layout: RankLayout, tmp_path: Path) -> None:
    mp.start_processes(_check_groups, args=(layout, str(tmp_path / "store"), str(tmp_path)),
                       nprocs=layout.world_size, start_method="spawn")
    assert sorted(p.name for p in tmp_path.glob("rank*")) == [f"rank{r}" for r in range(layout.world_size)]
