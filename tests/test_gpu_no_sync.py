"""On CUDA (needs a GPU): the paths tests/test_*_no_host_reads.py prove on CPU, run under
torch.cuda.set_sync_debug_mode("error") (any host wait raises) and captured in CUDA graphs whose replays equal the eager
run: the sampler's paths, the KV write with padding slots, the torch backend's packed decode, and the fixed-capacity
expert dispatch / grouped expert matmul / combine (an EP group of one: its all_to_all is the identity, every index
computation runs). Dual batch overlap on streams over a one-rank NCCL group: each ubatch on its own compute stream,
results equal to running the ubatches one after the other."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from raylm.runner.attention.kv_write import write_kv
from raylm.runner.attention.torch_paged_decode import decode_capacity, packed_paged_decode
from raylm.runner.distributed.fixed_capacity import FixedCapacityAll2All
from raylm.runner.group_coordinator import GroupCoordinator
from raylm.runner.layers.activation import SiluAndMul
from raylm.runner.layers.fused_moe import grouped_expert_mlp, select_experts, why_grouped_mm_syncs
from raylm.runner.sampler import Sampler
from raylm.runner.ubatching import dbo_overlap, run_ubatches, ubatch_streams
from tests.test_sampler import make_metadata
from tests.test_sampler_no_host_reads import CASES, HISTORY, VOCAB, cut

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda", 0)  # a runner's device has its index (the ubatch threads set it)


@contextmanager
def no_sync() -> Iterator[None]:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def captured(fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """fn run once (warm-up), then captured; the graph and its output tensors."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.parametrize("case", CASES)
def test_sampler_paths_wait_for_nothing(case: str) -> None:
    params = CASES[case]
    metadata = make_metadata(params, VOCAB, **cut(HISTORY, len(params)))
    metadata = type(metadata)(**{k: v.to(CUDA) if isinstance(v, torch.Tensor) else v
                                 for k, v in vars(metadata).items()})
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(3))
    expected = Sampler()(logits.clone(), make_metadata(params, VOCAB, **cut(HISTORY, len(params))))
    on_device = logits.to(CUDA)
    with no_sync():
        got = Sampler()(on_device, metadata)
    if all(p.temperature == 0 for p in params):
        assert torch.equal(got.sampled_token_ids.cpu(), expected.sampled_token_ids)


def test_kv_write_and_packed_decode_in_a_graph() -> None:
    torch.manual_seed(0)
    blocks, block_size, kv_heads, heads, head_size = 64, 16, 2, 8, 64
    cache = torch.randn(2, blocks, block_size, kv_heads, head_size, device=CUDA)
    slots = torch.tensor([5, -1, 130, -1], device=CUDA)
    key, value = (torch.randn(4, kv_heads, head_size, device=CUDA) for _ in range(2))
    table = torch.randint(0, blocks, (4, 12), dtype=torch.int32, device=CUDA)
    seq_lens = torch.tensor([1, 40, 190, 0], dtype=torch.int32, device=CUDA)
    query = torch.randn(4, heads, head_size, device=CUDA)
    capacity = decode_capacity(4, 12, blocks)

    def step() -> torch.Tensor:
        write_kv(cache[0].flatten(0, 1), cache[1].flatten(0, 1), slots, key, value)
        return packed_paged_decode(query, cache[0], cache[1], table, seq_lens, head_size**-0.5, capacity)

    with no_sync():
        eager = step()
    graph, out = captured(step)
    graph.replay()
    torch.testing.assert_close(out, eager)
    assert torch.equal(cache[0].flatten(0, 1)[130], key[2])


@pytest.mark.skipif(not torch.cuda.is_available() or why_grouped_mm_syncs(CUDA, torch.bfloat16) is not None,
                    reason="the experts' grouped matmul is one kernel on compute capability 9.x / 10.x only")
def test_fixed_capacity_experts_in_a_graph() -> None:
    torch.manual_seed(0)
    num_experts, top_k, hidden, inter, tokens, capacity = 8, 2, 256, 512, 6, 8
    exchange = FixedCapacityAll2All(GroupCoordinator([0], 0, device=CUDA), num_experts, top_k)
    w13 = torch.randn(num_experts, 2 * inter, hidden, dtype=torch.bfloat16, device=CUDA) / 16
    w2 = torch.randn(num_experts, hidden, inter, dtype=torch.bfloat16, device=CUDA) / 16
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=CUDA)
    router = torch.randn(tokens, num_experts, device=CUDA)

    def moe() -> torch.Tensor:
        weights, ids = select_experts(router, top_k, True)
        rows, experts, handle = exchange.dispatch(x, ids, weights, capacity)
        pair_rows = torch.arange(experts.numel(), device=CUDA) // experts.shape[1]
        out = grouped_expert_mlp(rows, experts.flatten(), w13, w2, SiluAndMul(), pair_rows)
        return exchange.combine(out, handle)

    with no_sync():
        eager = moe()
    weights, ids = select_experts(router, top_k, True)
    pair_rows = torch.arange(tokens * top_k, device=CUDA) // top_k
    direct = grouped_expert_mlp(x, ids.flatten(), w13, w2, SiluAndMul(), pair_rows).view(tokens, top_k, hidden)
    expected = (direct.float() * weights[..., None]).sum(1).to(torch.bfloat16)
    torch.testing.assert_close(eager, expected, atol=2e-2, rtol=2e-2)
    graph, out = captured(moe)
    graph.replay()
    assert torch.equal(out, eager)


def test_dbo_ubatches_run_on_their_own_streams(tmp_path: Path) -> None:
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        x, w = torch.randn(2, 512, 1024, device=CUDA), torch.randn(1024, 1024, device=CUDA) / 32
        seen: dict[int, torch.cuda.Stream] = {}

        def forward(i: int) -> Callable[[], torch.Tensor]:
            def run() -> torch.Tensor:
                seen[i] = torch.cuda.current_stream()
                h = x[i] @ w
                out = torch.empty_like(h)
                dbo_overlap(lambda: dist.all_to_all_single(out, h, async_op=True))
                return torch.relu(out) @ w
            return run

        results = run_ubatches([forward(0), forward(1)], [None, None], [512, 512], None, CUDA)
        for i in range(2):
            torch.testing.assert_close(results[i], torch.relu(x[i] @ w) @ w)
        streams = ubatch_streams(CUDA, 2)
        assert [seen[i] for i in range(2)] == [s.compute for s in streams]
        assert len({s.cuda_stream for s in (*seen.values(), torch.cuda.current_stream())}) == 3
    finally:
        dist.destroy_process_group()
