"""KV block pool and KV cache manager: allocation, freeing, prefix caching, LRU eviction."""
from __future__ import annotations

from raylm.cluster.core.block_pool import FreeKVCacheBlockQueue, KVCacheBlock, hash_block_tokens
from raylm.cluster.core.kv_cache_manager import KVCacheManager
from raylm.cluster.core.request import Request
from raylm.common.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id: str, token_ids: list[int], **params) -> Request:
    return Request(request_id, token_ids, SamplingParams(**params))


def admit(manager: KVCacheManager, request: Request) -> list[int] | None:
    """Admit the whole request as one step, with its prefix-cache hits (what the scheduler does)."""
    blocks, num_hit_tokens = manager.get_computed_blocks(request)
    block_ids = manager.allocate_slots(request, request.num_tokens - num_hit_tokens, num_hit_tokens, blocks)
    if block_ids is not None:
        request.num_computed_tokens = request.num_tokens
    return block_ids


def test_hash_is_stable_and_chained() -> None:
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert first == hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(first, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])


def test_free_queue_order() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.block_ids() == [0, 1, 2, 3, 4] and queue.num_free_blocks == 5
    queue.remove(blocks[2])
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    queue.appendleft(blocks[0])
    assert queue.block_ids() == [0, 1, 3, 4, 2] and queue.num_free_blocks == 5


def test_allocate_grow_and_free_without_caching() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_caching=False)
    request = make_request("a", list(range(10)))
    assert manager.get_computed_blocks(request) == ([], 0)
    assert manager.allocate_slots(request, 6) == [0, 1]
    request.num_computed_tokens = 6
    assert manager.allocate_slots(request, 2) == []  # still inside block 1
    request.num_computed_tokens = 8
    assert manager.allocate_slots(request, 2) == [2]
    assert manager.get_block_ids("a") == [0, 1, 2]
    assert manager.num_free_blocks == 5 and abs(manager.usage - 3 / 8) < 1e-9
    manager.free(request)
    assert manager.num_free_blocks == 8 and manager.usage == 0.0
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert manager.prefix_cache_queries == 0


def test_allocation_failure_changes_nothing() -> None:
    manager = KVCacheManager(num_blocks=2, block_size=BLOCK_SIZE)
    request = make_request("a", list(range(12)))
    assert manager.allocate_slots(request, 12) is None
    assert manager.num_free_blocks == 2 and manager.get_block_ids("a") == []
    assert manager.prefix_cache_queries == 0


def test_prefix_hit_shares_blocks() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    prefix = list(range(100, 112))  # three full blocks
    first = make_request("a", prefix + [1, 2])
    assert admit(manager, first) == [0, 1, 2, 3]
    second = make_request("b", prefix + [3, 4, 5])
    blocks, num_hit_tokens = manager.get_computed_blocks(second)
    assert [block.block_id for block in blocks] == [0, 1, 2] and num_hit_tokens == 12
    assert manager.allocate_slots(second, 3, num_hit_tokens, blocks) == [4]
    assert manager.get_block_ids("b") == [0, 1, 2, 4]
    assert [manager.block_pool.blocks[i].ref_cnt for i in range(5)] == [2, 2, 2, 1, 1]
    assert manager.prefix_cache_queries == 14 + 15 and manager.prefix_cache_hits == 12


def test_hits_leave_the_last_prompt_token_to_compute() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    prompt = list(range(12))  # exactly three full blocks
    admit(manager, make_request("a", prompt))
    blocks, num_hit_tokens = manager.get_computed_blocks(make_request("b", prompt))
    assert len(blocks) == 2 and num_hit_tokens == 8


def test_no_hits_when_disabled_or_prompt_logprobs() -> None:
    prompt = list(range(9))
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, enable_caching=False)
    admit(manager, make_request("a", prompt))
    assert manager.get_computed_blocks(make_request("b", prompt)) == ([], 0)

    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    admit(manager, make_request("a", prompt))
    assert manager.get_computed_blocks(make_request("b", prompt, prompt_logprobs=1)) == ([], 0)
    # Resumed after preemption with outputs: its prompt logprobs were reported, so hits are fine again.
    resumed = make_request("c", prompt, prompt_logprobs=1)
    resumed.append_output_token_id(5)
    assert manager.get_computed_blocks(resumed)[1] == 8


def test_freed_blocks_stay_cached_and_are_reused() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    prompt = list(range(50, 63))  # 3 full blocks + 1 token
    first = make_request("a", prompt)
    admit(manager, first)
    manager.free(first)
    assert manager.num_free_blocks == 8
    # The partial tail block (uncached) is reused first; cached ones are freed tail-first so a
    # prompt's head is evicted last.
    assert manager.block_pool.free_block_queue.block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    again = make_request("b", prompt)
    blocks, num_hit_tokens = manager.get_computed_blocks(again)
    assert [block.block_id for block in blocks] == [0, 1, 2] and num_hit_tokens == 12
    manager.allocate_slots(again, 1, num_hit_tokens, blocks)
    assert manager.num_free_blocks == 4
    assert all(manager.block_pool.blocks[i].ref_cnt == 1 for i in (0, 1, 2))


def test_lru_eviction_under_pressure() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE)
    cached_prompt = list(range(16))  # four full blocks
    first = make_request("a", cached_prompt)
    admit(manager, first)
    manager.free(first)
    assert manager.block_pool.free_block_queue.block_ids() == [4, 5, 3, 2, 1, 0]
    other = make_request("x", list(range(500, 512)))  # needs three fresh blocks: evicts block 3
    assert admit(manager, other) == [4, 5, 3]
    assert len(manager.block_pool.cached_block_hash_to_block) == 3 + 3  # a's head + x's own full blocks
    manager.free(other)
    blocks, num_hit_tokens = manager.get_computed_blocks(make_request("b", cached_prompt + [99]))
    assert [block.block_id for block in blocks] == [0, 1, 2] and num_hit_tokens == 12


def test_free_hits_count_against_free_blocks() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    prompt = list(range(12))
    first = make_request("a", prompt + [0])
    admit(manager, first)
    manager.free(first)
    holder = make_request("h", [7])
    admit(manager, holder)  # takes the one uncached free block; the three cached ones are left
    assert manager.num_free_blocks == 3
    request = make_request("b", prompt + [1])
    blocks, num_hit_tokens = manager.get_computed_blocks(request)
    assert num_hit_tokens == 12
    # Three hits leave the free queue and one new block is needed: 4 > 3.
    assert manager.allocate_slots(request, 1, num_hit_tokens, blocks) is None
    assert manager.num_free_blocks == 3 and all(block.ref_cnt == 0 for block in blocks)


def test_same_content_computed_twice_is_cached_once() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    prompt = list(range(13))
    first = make_request("a", prompt)
    manager.allocate_slots(first, 4)  # a chunk: only block 0 is known and hashed
    first.num_computed_tokens = 4
    second = make_request("b", prompt)
    blocks, num_hit_tokens = manager.get_computed_blocks(second)
    assert num_hit_tokens == 4
    manager.allocate_slots(second, 9, num_hit_tokens, blocks)  # b computes blocks 1, 2 itself
    manager.allocate_slots(first, 9)  # and so does a: same hashes, kept uncached
    pool = manager.block_pool
    assert len(pool.cached_block_hash_to_block) == 3
    assert [pool.blocks[i].block_hash is None for i in manager.get_block_ids("a")] == [False, True, True, True]
    manager.free(first)
    manager.free(second)
    assert manager.num_free_blocks == 16


def test_reset_prefix_cache() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    prompt = list(range(9))
    first = make_request("a", prompt)
    admit(manager, first)
    assert manager.reset_prefix_cache() is False  # blocks in use
    manager.free(first)
    assert manager.reset_prefix_cache() is True
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert all(block.block_hash is None for block in manager.block_pool.blocks)
    assert manager.get_computed_blocks(make_request("b", prompt)) == ([], 0)
