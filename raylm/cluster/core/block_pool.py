"""The paged KV cache as the scheduler sees it: `num_blocks` blocks with reference counts, a free
queue in eviction order, and the prefix cache (block hash -> block).

Every block id 0..num_blocks-1 is usable; none is reserved as a null block (padded slots write to
no block, see DESIGN 5). A free block with a hash still holds valid KV: it stays in the prefix cache
until it is handed out again (evicted), which takes blocks from the head of the free queue.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Iterable


def hash_block_tokens(parent_hash: bytes | None, token_ids: list[int]) -> bytes:
    """Stable across processes: sha256 over the parent's hash and the tokens as int64."""
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None  # set while this block is the prefix cache's entry
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeKVCacheBlockQueue:
    """Doubly-linked list of free blocks: O(1) pop from the head, push at either end, and removal
    from the middle (a prefix hit on a free block takes it out of the queue)."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels: no None checks on the hot path
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        assert block is not self._tail and block is not None, "no free block"
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, f"{block} is not in the free queue"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, prev: KVCacheBlock | None, block: KVCacheBlock) -> None:
        assert prev is not None and block.prev_free is None and block.next_free is None
        nxt = prev.next_free
        assert nxt is not None
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = nxt.prev_free = block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Head (evicted first) to tail; for tests and debugging."""
        ids, block = [], self._head.next_free
        while block is not self._tail and block is not None:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        # Told (block id, hash) of each cached block handed out again, before its KV is overwritten (KV offloading).
        self.on_evict: Callable[[int, bytes], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take blocks from the head of the free queue, evicting their cached contents."""
        assert num_blocks <= self.num_free_blocks, f"asked for {num_blocks} blocks, {self.num_free_blocks} free"
        blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            assert block.ref_cnt == 0
            if block.block_hash is not None:
                if self.on_evict is not None:
                    self.on_evict(block.block_id, block.block_hash)
                del self.cached_block_hash_to_block[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference to prefix-cache hits; a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Register a full block. If another block already holds the same content, keep that one:
        this block then stays uncached and is reused first once freed."""
        assert block.block_hash is None and block.ref_cnt > 0
        if block_hash not in self.cached_block_hash_to_block:
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the given order. A block no longer used goes to the
        tail of the free queue if it holds cached KV (evicted last), to the head if not (reused first)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_block_queue.appendleft(block)
                else:
                    self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True
