"""Which KV blocks each request holds: prefix-cache lookup on admission, slot allocation as
tokens are scheduled, and freeing.

Where every layer attends over a sliding window (Mistral), a request's leading blocks that no later query can see
go back to the pool as its window moves (vLLM's SlidingWindowManager.remove_skipped_blocks), so it holds about
window / block_size + 1 blocks however long it grows. Its block table keeps their ids in place: the kernels mask
those positions, so they never count what another request writes there. Models that mix sliding and global layers
(Gemma 2 / 3, GPT-OSS) keep their sliding layers' blocks in a group of their own that frees them the same way
(sliding_window_group.py; configs/kv_cache_groups.py says where), the global layers' blocks here.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from raylm.cluster.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from raylm.cluster.core.lora_scheduling import block_hash_seed
from raylm.cluster.core.request import Request
from raylm.cluster.core.sliding_window_group import SlidingWindowGroup
from raylm.configs.attention_backends import layer_sliding_windows

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def freeing_window(hf_configs: Sequence[PretrainedConfig | None]) -> int | None:
    """The window past which blocks can be freed when every layer of these models (the target and a draft model,
    which share the block table) slides: the widest one, so that no layer loses a key it sees. None when any layer
    is global, or a config is unknown."""
    windows = [window for config in hf_configs
               for window in (layer_sliding_windows(config) if config is not None else [None])]
    if not windows or any(window is None for window in windows):
        return None
    return max(window for window in windows if window is not None)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None, sliding_group: SlidingWindowGroup | None = None) -> None:
        assert block_size > 0 and (sliding_window is None or sliding_window > 0)
        assert sliding_window is None or sliding_group is None, 'every layer slides, or only some do'
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window  # None: a request keeps all its blocks until it ends
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.sliding_group = sliding_group  # the sliding layers' blocks of a model mixing them with global ones
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Leading blocks of each request already back in the pool (sliding window only); their ids stay in place.
        self.num_skipped_blocks: dict[str, int] = {}
        # How many leading blocks of each request have been offered to the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Prompt tokens looked up / found in the prefix cache, counted once per admission.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """The fuller pool's fraction in use: with a sliding group, whichever of the two pools runs out first is
        what stops admission (the router and the metric read this)."""
        sliding = self.sliding_group.block_pool.usage if self.sliding_group is not None else 0.0
        return max(self.block_pool.usage, sliding)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def check_fits(self, request: Request) -> None:
        """Raises ValueError if the request, alone in the pool, could not finish: every token but the last sampled
        one needs a KV slot."""
        num_blocks_needed = self.blocks_needed(request.num_prompt_tokens + request.max_tokens - 1)
        if num_blocks_needed > self.num_blocks:
            raise ValueError(
                f"request {request.request_id!r} can never fit in the KV cache: {request.num_prompt_tokens} prompt "
                f"tokens + up to {request.max_tokens} generated need {num_blocks_needed} blocks of {self.block_size} "
                f"tokens, the pool has {self.num_blocks}; lower max_tokens or give the KV cache more memory")

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of full blocks. At least the last token is always left to compute
        so that the step that finishes the prefill produces logits. Nothing is touched here."""
        assert request.num_computed_tokens == 0 and request.request_id not in self.req_to_blocks
        if not self.enable_caching or (request.sampling_params.prompt_logprobs is not None
                                       and request.num_output_tokens == 0):
            return [], 0  # prompt logprobs need the logits of every prompt position (until they are reported)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        self._update_block_hashes(request, max_hit_blocks)
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        if self.sliding_group is not None:
            hits = hits[:self.sliding_group.num_hit_blocks(request.block_hashes, len(hits))]
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones (plus, on admission, the
        prefix hits `new_computed_blocks` covering `num_new_computed_tokens`), and `num_lookahead_tokens` slots past
        them (a draft model's drafts). Returns the ids of the freshly allocated blocks (maybe none), or None, changing
        nothing, when the pool is too small. `delay_cache_blocks`: the new blocks' KV arrives from elsewhere later;
        they enter the prefix cache on the request's next allocation, not before their KV is there."""
        new_computed_blocks = new_computed_blocks or []
        assert num_new_tokens > 0 and num_new_computed_tokens == len(new_computed_blocks) * self.block_size
        req_blocks = self.req_to_blocks.get(request.request_id)
        admitting = req_blocks is None
        assert admitting or not new_computed_blocks, "prefix hits are only taken on admission"
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        sliding = self.sliding_group
        if req_blocks is not None:
            self.remove_skipped_blocks(request, num_computed)  # room for this step's blocks
            if sliding is not None:
                sliding.remove_skipped_blocks(request, num_computed)
        num_total_blocks = -(-(num_computed + num_new_tokens + num_lookahead_tokens) // self.block_size)
        # Never negative but for speculative decoding: the slots of rejected drafts stay with the request, and the
        # next step's tokens reuse them.
        num_new_blocks = max(0, num_total_blocks - (0 if req_blocks is None else len(req_blocks))
                             - len(new_computed_blocks))
        block_pool = self.block_pool
        # Hits sitting in the free queue leave it, so they count against the free blocks too.
        num_free_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0) if new_computed_blocks else 0
        if num_new_blocks + num_free_hits > block_pool.num_free_blocks or sliding is not None and (
                sliding.num_blocks_to_take(request, num_total_blocks, len(new_computed_blocks))
                > sliding.block_pool.num_free_blocks):
            return None

        if req_blocks is None:
            req_blocks = self.req_to_blocks[request.request_id] = []
            self.num_cached_blocks[request.request_id] = len(new_computed_blocks)
            self.num_skipped_blocks[request.request_id] = 0
            if self.enable_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_new_computed_tokens
        if new_computed_blocks:
            block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
        # Most steps of a running request fit in the blocks it holds: no pool work then.
        new_block_ids: list[int] = []
        if num_new_blocks:
            new_blocks = block_pool.get_new_blocks(num_new_blocks)
            req_blocks.extend(new_blocks)
            new_block_ids = [block.block_id for block in new_blocks]
        if sliding is not None:
            sliding.allocate(request, num_total_blocks, len(new_computed_blocks))

        if self.enable_caching and not delay_cache_blocks:
            # Only known token ids can be hashed: under async scheduling the scheduled tokens may run
            # ahead of the sampled ones.
            self._cache_full_blocks(request, min(num_computed + num_new_tokens, request.num_tokens) // self.block_size)
        self.remove_skipped_blocks(request, num_computed)  # prefix hits already out of the window
        if sliding is not None:
            sliding.remove_skipped_blocks(request, num_computed)
        return new_block_ids

    def remove_skipped_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Free the request's leading blocks that lie wholly before the window of every query it has yet to run:
        the lowest such query is its first uncomputed token, or, while speculative drafts or async steps are out,
        its last known token (a rejected draft's position is queried again). A block is freed only once it has been
        offered to the prefix cache, so that it stays a hit until evicted. Steps already dispatched may still read
        a freed block: whoever gets it next writes it in a later step, which the device runs after them."""
        if self.sliding_window is None:
            return
        request_id = request.request_id
        first_query = min(num_computed_tokens, request.num_tokens - 1)
        num_skipped = max(0, first_query - self.sliding_window + 1) // self.block_size
        if self.enable_caching:
            num_skipped = min(num_skipped, self.num_cached_blocks[request_id])
        start = self.num_skipped_blocks[request_id]
        if num_skipped > start:
            # Last first, as in free(): a prompt's head is the part other requests likeliest share.
            self.block_pool.free_blocks(reversed(self.req_to_blocks[request_id][start:num_skipped]))
            self.num_skipped_blocks[request_id] = num_skipped

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds in the pool (its skipped ones are back there)."""
        return len(self.req_to_blocks.get(request_id, ())) - self.num_skipped_blocks.get(request_id, 0)

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first so that a prompt's tail is evicted before
        its head (the head is the part other requests are likeliest to share)."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        num_skipped = self.num_skipped_blocks.pop(request.request_id, 0)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks[num_skipped:]))
        if self.sliding_group is not None:
            self.sliding_group.free(request.request_id)

    def get_block_ids(self, request_id: str) -> list[int]:
        """One id per block position of the request, skipped (freed) positions included: see the module's doc."""
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def get_sliding_block_ids(self, request_id: str) -> list[int]:
        """The sliding layers' ids, one per block position as get_block_ids' (empty without a sliding group)."""
        return [] if self.sliding_group is None else self.sliding_group.get_block_ids(request_id)

    def reset_prefix_cache(self) -> bool:
        if self.sliding_group is not None and not self.sliding_group.block_pool.reset_prefix_cache():
            return False
        return self.block_pool.reset_prefix_cache()

    def _cache_full_blocks(self, request: Request, num_full_blocks: int) -> None:
        num_cached = self.num_cached_blocks[request.request_id]
        if num_full_blocks <= num_cached:
            return
        self._update_block_hashes(request, num_full_blocks)
        blocks = self.req_to_blocks[request.request_id]
        for i in range(num_cached, num_full_blocks):
            self.block_pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = num_full_blocks
        if self.sliding_group is not None:
            self.sliding_group.cache_full_blocks(request, num_full_blocks)

    def _update_block_hashes(self, request: Request, num_full_blocks: int) -> None:
        """Extend `request.block_hashes` to its first `num_full_blocks` blocks (hashing only new ones)."""
        hashes, size = request.block_hashes, self.block_size
        assert num_full_blocks * size <= request.num_tokens
        for i in range(len(hashes), num_full_blocks):
            parent = hashes[i - 1] if i else block_hash_seed(request.lora_request)  # adapters never share KV
            hashes.append(hash_block_tokens(parent, request.all_token_ids[i * size:(i + 1) * size]))
