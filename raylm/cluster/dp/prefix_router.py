"""Prefix-aware routing (routing_policy "prefix"): send a request where its prompt's prefix is cached, unless that
would unbalance the load.

PrefixRouter keeps, per target (a data-parallel engine, a Serve replica), the chained hashes of the prompt blocks it was
sent lately, least recently used first out beyond what the target can cache: an estimate of its prefix cache built from
recent prompts, as Ray Serve LLM's PrefixCacheAffinityRouter and SGLang's router do. While the targets' loads are
within `routing_imbalanced_threshold` of each other, a request goes to the target holding the longest run of its
leading blocks, if that covers at least `routing_match_rate_threshold` of them; otherwise to the least loaded (among
equals, the one caching the least). PrefixAwareLoadBalancer is the DP client's balancer under this policy.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Generic, TypeVar

from raylm.cluster.core.block_pool import hash_block_tokens
from raylm.cluster.dp.dp_load_balancer import DPLoadBalancer
from raylm.configs.kv_transfer import RoutingConfig

T = TypeVar("T", bound=Hashable)


def token_block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The chained hashes of the prompt's whole blocks (the engines' prefix-cache keys)."""
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, list(token_ids[start:start + block_size])))
    return hashes


def text_block_hashes(text: str, chunk_bytes: int = 64) -> list[bytes]:
    """Chained hashes of a text's whole chunks of UTF-8 bytes: prefix keys where the tokens are not known yet."""
    data = text.encode()
    hashes: list[bytes] = []
    for start in range(0, len(data) - chunk_bytes + 1, chunk_bytes):
        hashes.append(hashlib.sha256((hashes[-1] if hashes else b"") + data[start:start + chunk_bytes]).digest())
    return hashes


class PrefixRouter(Generic[T]):
    def __init__(self, routing_config: RoutingConfig) -> None:
        self.imbalanced_threshold = routing_config.routing_imbalanced_threshold
        self.match_rate_threshold = routing_config.routing_match_rate_threshold
        self._blocks: dict[T, OrderedDict[bytes, None]] = {}
        self._capacity: dict[T, int] = {}
        self.num_prefix_routed = 0  # requests sent to their best match
        self.num_load_routed = 0  # requests sent to the least loaded (imbalance, or no match worth it)

    def set_capacity(self, target: T, num_blocks: int) -> None:
        """How many blocks the target can cache (its KV pool); its index is kept within that."""
        self._capacity[target] = max(1, num_blocks)
        self._blocks.setdefault(target, OrderedDict())
        self._trim(target)

    def targets(self) -> list[T]:
        return list(self._blocks)

    def remove(self, target: T) -> None:
        self._blocks.pop(target, None)
        self._capacity.pop(target, None)

    def match(self, target: T, hashes: list[bytes]) -> int:
        """How many of the leading hashes the target holds."""
        blocks = self._blocks.get(target)
        count = 0
        while blocks is not None and count < len(hashes) and hashes[count] in blocks:
            count += 1
        return count

    def choose(self, hashes: list[bytes], loads: dict[T, float]) -> T:
        """The target for a prompt with these block hashes, given the live targets' loads (in preference order for
        ties); the prompt's blocks are recorded as cached there."""
        assert loads, "no target to route to"
        order = {target: i for i, target in enumerate(loads)}

        def least_loaded_key(target: T) -> tuple[float, int, int]:
            return loads[target], len(self._blocks.get(target, ())), order[target]

        chosen, by_prefix = min(loads, key=least_loaded_key), False
        if hashes and max(loads.values()) - min(loads.values()) <= self.imbalanced_threshold:
            matches = {target: self.match(target, hashes) for target in loads}
            best = max(loads, key=lambda target: (matches[target], -loads[target], -order[target]))
            if matches[best] and matches[best] >= self.match_rate_threshold * len(hashes):
                chosen, by_prefix = best, True
        if by_prefix:
            self.num_prefix_routed += 1
        else:
            self.num_load_routed += 1
        self.insert(chosen, hashes)
        return chosen

    def insert(self, target: T, hashes: list[bytes]) -> None:
        blocks = self._blocks.setdefault(target, OrderedDict())
        for block_hash in hashes:
            blocks[block_hash] = None
            blocks.move_to_end(block_hash)
        self._trim(target)

    def _trim(self, target: T) -> None:
        blocks, capacity = self._blocks[target], self._capacity.get(target)
        while capacity is not None and len(blocks) > capacity:
            blocks.popitem(last=False)


class PrefixAwareLoadBalancer(DPLoadBalancer):
    """DPLoadBalancer's load score (4 x waiting + running, requests in flight counted as waiting) with PrefixRouter's
    choice among the live engines."""

    def __init__(self, num_blocks: list[int], block_size: int, routing_config: RoutingConfig) -> None:
        super().__init__(len(num_blocks))
        self.block_size = block_size
        self.router: PrefixRouter[int] = PrefixRouter(routing_config)
        for index, blocks in enumerate(num_blocks):
            self.router.set_capacity(index, blocks)

    def choose(self, prompt_token_ids: list[int] | None = None) -> int:
        live = [i for i, load in enumerate(self.engines) if load.alive]
        if not live:
            raise RuntimeError("no data-parallel engine is alive")
        hashes = token_block_hashes(prompt_token_ids or [], self.block_size)
        index = self.router.choose(hashes, {i: float(self.engines[i].score) for i in live})
        self.engines[index].num_sent += 1
        return index

    def mark_dead(self, index: int) -> None:
        super().mark_dead(index)
        self.router.remove(index)


def make_dp_balancer(routing_policy: str, routing_config: RoutingConfig, num_blocks: list[int],
                     block_size: int) -> DPLoadBalancer:
    """The DP client's balancer for the resolved routing_policy ("load" or "prefix")."""
    if routing_policy == "prefix":
        return PrefixAwareLoadBalancer(num_blocks, block_size, routing_config)
    assert routing_policy == "load", f"routing_policy {routing_policy!r} is unresolved"
    return DPLoadBalancer(len(num_blocks))
