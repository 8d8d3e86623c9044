"""The sliding-window layers' KV cache group of a model that mixes them with global layers (Gemma 2 / 3, GPT-OSS):
a block pool of their own, and per request one block per position, of which the leading ones its window has passed
go back to the pool as it grows (vLLM's SlidingWindowManager), so that it holds about window / block_size + 1 of
them however long it grows. The global layers' blocks stay in KVCacheManager.

Freed positions keep their ids in the request's block table, and a prefix hit's positions before the window get id 0:
the kernels mask every key outside a layer's window, so those slots are never counted. A prefix hit needs both
groups' blocks: the global layers' for the whole prefix and these for the window of its first uncomputed token."""
from __future__ import annotations

from raylm.cluster.core.block_pool import BlockPool, KVCacheBlock
from raylm.cluster.core.request import Request


class SlidingWindowGroup:
    def __init__(self, num_blocks: int, block_size: int, sliding_window: int, enable_caching: bool) -> None:
        assert sliding_window > 0
        self.block_size, self.sliding_window, self.enable_caching = block_size, sliding_window, enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # None: a position before the window of the request's first query on admission (a prefix hit's head).
        self.req_to_blocks: dict[str, list[KVCacheBlock | None]] = {}
        self.num_skipped_blocks: dict[str, int] = {}  # leading positions already back in the pool (or None)
        self.num_cached_blocks: dict[str, int] = {}  # leading positions offered to the prefix cache

    def first_visible_block(self, first_query: int) -> int:
        """The first block position holding a key the query at position `first_query` (and any later one) sees."""
        return max(0, first_query - self.sliding_window + 1) // self.block_size

    def num_hit_blocks(self, block_hashes: list[bytes], num_global_hits: int) -> int:
        """The longest prefix, of at most `num_global_hits` blocks, whose window blocks this group still caches."""
        pool = self.block_pool
        for num_hits in range(num_global_hits, 0, -1):
            start = self.first_visible_block(num_hits * self.block_size)
            if all(pool.get_cached_block(block_hash) is not None for block_hash in block_hashes[start:num_hits]):
                return num_hits
        return 0

    def _hits(self, request: Request, num_hit_blocks: int) -> list[KVCacheBlock]:
        start = self.first_visible_block(num_hit_blocks * self.block_size)
        hits = [self.block_pool.get_cached_block(h) for h in request.block_hashes[start:num_hit_blocks]]
        assert all(hit is not None for hit in hits), "num_hit_blocks found them in this same scheduling step"
        return [hit for hit in hits if hit is not None]

    def num_blocks_to_take(self, request: Request, num_total_blocks: int, num_hit_blocks: int) -> int:
        """Free blocks that allocate() would take: new ones, and hits sitting in the free queue."""
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is not None:
            return max(0, num_total_blocks - len(blocks))
        hits = self._hits(request, num_hit_blocks)
        return num_total_blocks - num_hit_blocks + sum(1 for block in hits if block.ref_cnt == 0)

    def allocate(self, request: Request, num_total_blocks: int, num_hit_blocks: int) -> None:
        """Cover `num_total_blocks` positions; on admission the first `num_hit_blocks` are prefix hits (call
        num_blocks_to_take first: the pool has room)."""
        blocks: list[KVCacheBlock | None] | None = self.req_to_blocks.get(request.request_id)
        if blocks is None:
            hits = self._hits(request, num_hit_blocks)
            self.block_pool.touch(hits)
            start = num_hit_blocks - len(hits)
            blocks = [None] * start
            blocks.extend(hits)
            self.req_to_blocks[request.request_id] = blocks
            self.num_skipped_blocks[request.request_id] = start
            self.num_cached_blocks[request.request_id] = num_hit_blocks
        if num_total_blocks > len(blocks):
            blocks.extend(self.block_pool.get_new_blocks(num_total_blocks - len(blocks)))

    def cache_full_blocks(self, request: Request, num_full_blocks: int) -> None:
        """Offer the request's first `num_full_blocks` blocks (their hashes already in request.block_hashes)."""
        num_cached = self.num_cached_blocks[request.request_id]
        blocks = self.req_to_blocks[request.request_id]
        for i in range(num_cached, num_full_blocks):
            block = blocks[i]
            if block is not None and block.block_hash is None:
                self.block_pool.cache_block(block, request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = max(num_cached, num_full_blocks)

    def remove_skipped_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Free the leading blocks before the window of every query the request has yet to run (the same rule as
        KVCacheManager.remove_skipped_blocks): only once offered to the prefix cache, so they stay hits."""
        request_id = request.request_id
        num_skipped = self.first_visible_block(min(num_computed_tokens, request.num_tokens - 1))
        if self.enable_caching:
            num_skipped = min(num_skipped, self.num_cached_blocks[request_id])
        start = self.num_skipped_blocks[request_id]
        if num_skipped > start:
            blocks = self.req_to_blocks[request_id][start:num_skipped]
            self.block_pool.free_blocks(block for block in reversed(blocks) if block is not None)
            self.num_skipped_blocks[request_id] = num_skipped

    def num_held_blocks(self, request_id: str) -> int:
        return len(self.req_to_blocks.get(request_id, ())) - self.num_skipped_blocks.get(request_id, 0)

    def free(self, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, None)
        num_skipped = self.num_skipped_blocks.pop(request_id, 0)
        self.num_cached_blocks.pop(request_id, None)
        if blocks:
            self.block_pool.free_blocks(block for block in reversed(blocks[num_skipped:]) if block is not None)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [0 if block is None else block.block_id for block in self.req_to_blocks.get(request_id, ())]
