"""Micro-batching without torch.distributed: where the cut falls (inside a request, on a request boundary), the
empty-side veto, the thresholds, each ubatch's attention metadata (the two ubatches run in order give the unsliced
attention, on both backends), and the ping-pong hand-off between the ubatch threads."""
from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch

from raylm.configs import make_engine_config
from raylm.runner.attention.backend import AttentionBackend
from raylm.runner.batch_descriptor import CUDAGraphMode
from raylm.runner.dp_utils import synchronize_dp_ranks
from raylm.runner.forward_context import get_forward_context
from raylm.runner.ubatch_splitting import (
    UBatchSlice,
    check_ubatch_thresholds,
    create_ubatch_slices,
    slice_attn_metadata,
)
from raylm.runner.ubatching import current_ubatch_id, dbo_yield, run_ubatches
from tests.test_attention_torch import make_common_metadata
from tests.test_batch_padding import backends

NONE = CUDAGraphMode.NONE
HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 4, 2, 16, 16


def test_cut_inside_a_request() -> None:
    # Requests of 3, 7 and 2 tokens padded to 14: the cut at 7 falls in the second request, which is in both.
    slices = create_ubatch_slices(np.array([0, 3, 10, 12]), num_tokens=12, num_tokens_padded=14)
    assert slices == [UBatchSlice(slice(0, 2), slice(0, 7)), UBatchSlice(slice(1, 3), slice(7, 14))]
    assert [u.num_tokens for u in slices] == [7, 7]


def test_cut_on_a_request_boundary() -> None:
    slices = create_ubatch_slices(np.array([0, 3, 6]), num_tokens=6, num_tokens_padded=6)
    assert slices == [UBatchSlice(slice(0, 1), slice(0, 3)), UBatchSlice(slice(1, 2), slice(3, 6))]
    # A dummy batch has tokens but no requests.
    assert create_ubatch_slices(None, 4, 4) == [UBatchSlice(slice(0, 0), slice(0, 2)),
                                               UBatchSlice(slice(0, 0), slice(2, 4))]


def test_empty_side_vetoes_slicing() -> None:
    # One token per rank: the first ubatch would be empty.
    assert not synchronize_dp_ranks([1, 1], [1, 1], [True, True], [NONE, NONE]).should_ubatch
    # Rank 0's 3 tokens all fall before the cut at 5 of the padded 10: its last ubatch would be padding only.
    assert not synchronize_dp_ranks([3, 10], [3, 10], [True, True], [NONE, NONE]).should_ubatch
    assert synchronize_dp_ranks([6, 10], [6, 10], [True, True], [NONE, NONE]).should_ubatch
    with pytest.raises(AssertionError):
        create_ubatch_slices(np.array([0, 3]), num_tokens=3, num_tokens_padded=10)


def test_ranks_that_disagree_do_not_slice() -> None:
    decision = synchronize_dp_ranks([40, 40], [40, 40], [True, False], [NONE, NONE])
    assert not decision.should_ubatch and decision.num_tokens_across_dp == [40, 40]


def test_thresholds() -> None:
    parallel = make_engine_config(data_parallel_size=2, enable_expert_parallel=True, enable_dbo=True,
                                  dbo_decode_token_threshold=4, dbo_prefill_token_threshold=10).parallel_config
    assert [check_ubatch_thresholds(parallel, n, True) for n in (3, 4)] == [False, True]
    assert [check_ubatch_thresholds(parallel, n, False) for n in (9, 10)] == [False, True]
    assert not check_ubatch_thresholds(make_engine_config().parallel_config, 1000, False)  # enable_dbo off
    parallel = make_engine_config(data_parallel_size=2, enable_expert_parallel=True, enable_dbo=True,
                                  dbo_decode_token_threshold=1, dbo_prefill_token_threshold=1).parallel_config
    assert not check_ubatch_thresholds(parallel, 1, True)  # one token cannot be cut


def test_vllm_default_thresholds() -> None:
    parallel = make_engine_config().parallel_config
    assert (parallel.enable_dbo, parallel.dbo_decode_token_threshold, parallel.dbo_prefill_token_threshold) == (
        False, 32, 512)


@pytest.mark.parametrize("backend_cls", backends())
@pytest.mark.parametrize("query_lens, seq_lens, padded", [([3, 7, 2], [3, 10, 5], 14), ([3, 3], [9, 3], 6),
                                                          ([1, 1, 1, 1, 1], [4, 17, 2, 33, 8], 8)])
def test_ubatches_in_order_give_the_unsliced_attention(backend_cls: type[AttentionBackend], query_lens: list[int],
                                                       seq_lens: list[int], padded: int) -> None:
    generator = torch.Generator().manual_seed(3)
    backend = backend_cls()
    tables = [[2 * i, 2 * i + 1, 2 * i + 10] for i in range(len(seq_lens))]
    num_tokens = sum(query_lens)
    common, _ = make_common_metadata(query_lens, seq_lens, tables, BLOCK_SIZE, padded - num_tokens)
    shape = backend.get_kv_cache_shape(32, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
    kv_cache = torch.randn(shape, generator=generator)
    query = torch.randn(padded, HEADS, HEAD_SIZE, generator=generator)
    key, value = (torch.randn(padded, KV_HEADS, HEAD_SIZE, generator=generator) for _ in range(2))
    sliced_cache = kv_cache.clone()
    expected = backend.forward(query, key, value, kv_cache, backend.build(common), HEAD_SIZE**-0.5)

    outputs = []
    for ubatch in create_ubatch_slices(common.query_start_loc_cpu.numpy(), num_tokens, padded):
        metadata = backend.build(slice_attn_metadata(common, ubatch))
        rows = ubatch.token_slice
        outputs.append(backend.forward(query[rows], key[rows], value[rows], sliced_cache, metadata, HEAD_SIZE**-0.5))
    torch.testing.assert_close(torch.cat(outputs), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sliced_cache, kv_cache)


def test_sliced_metadata_of_a_cut_request() -> None:
    common, _ = make_common_metadata([3, 7, 2], [3, 10, 5], [[0], [1], [2]], BLOCK_SIZE, 2)
    first, second = (slice_attn_metadata(common, u) for u in create_ubatch_slices(np.array([0, 3, 10, 12]), 12, 14))
    # The cut request (3 cached tokens, 7 new): its sequence ends at its 4th new token in ubatch 0 (7 keys), its
    # last 3 tokens query all 10 keys in ubatch 1.
    assert first.query_start_loc_cpu.tolist() == [0, 3, 7] and first.seq_lens_cpu.tolist() == [3, 7]
    assert second.query_start_loc_cpu.tolist() == [0, 3, 5] and second.seq_lens_cpu.tolist() == [10, 5]
    assert (first.num_actual_tokens, second.num_actual_tokens) == (7, 5)  # ubatch 1's 2 padding rows excluded
    assert torch.equal(second.slot_mapping, common.slot_mapping[7:12])
    assert (second.max_query_len, second.max_seq_len, second.num_reqs) == (3, 10, 2)
    assert common.seq_lens_cpu.tolist() == [3, 10, 5]  # the step's metadata is untouched


def run_logged(num_yields: list[int]) -> list[tuple[int, int]]:
    """Two ubatch threads that log (ubatch, segment) between yields."""
    log: list[tuple[int, int]] = []

    def forward(ubatch: int) -> Any:
        def run() -> int:
            assert current_ubatch_id() == ubatch and get_forward_context().num_tokens == 10 + ubatch
            for segment in range(num_yields[ubatch] + 1):
                log.append((ubatch, segment))
                dbo_yield()
            return ubatch * 100

        return run

    results = run_ubatches([forward(0), forward(1)], [None, None], [10, 11], None, torch.device("cpu"))
    assert results == [0, 100] and current_ubatch_id() is None
    return log


def test_ubatch_threads_take_turns_in_a_fixed_order() -> None:
    assert run_logged([3, 3]) == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (0, 3), (1, 3)]
    # One ubatch with fewer hand-offs: the other goes on alone, without waiting for a turn that never comes.
    assert run_logged([1, 3]) == [(0, 0), (1, 0), (0, 1), (1, 1), (1, 2), (1, 3)]
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("ubatch-")]


def test_an_error_in_a_ubatch_is_raised_without_a_hang() -> None:
    def fails() -> None:
        raise ValueError("ubatch 1 failed")

    def yields() -> None:
        dbo_yield()
        dbo_yield()

    with pytest.raises(ValueError, match="ubatch 1 failed"):
        run_ubatches([yields, fails], [None, None], [1, 1], None, torch.device("cpu"))
