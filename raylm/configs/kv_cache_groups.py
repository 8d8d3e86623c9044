"""KV cache groups (vLLM's kv_cache_groups): where a model mixes sliding-window and global layers (Gemma 2 / 3,
GPT-OSS), the sliding layers keep their KV in a pool and block table of their own, from which each request's blocks
that its window has passed go back as it grows (cluster/core/sliding_window_group.py), while the global layers keep
every block. The scheduler and the runner both derive the split here from the same settings, so they agree on it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from raylm.configs.attention_backends import layer_sliding_windows

if TYPE_CHECKING:
    from raylm.configs.engine_config import EngineConfig


@dataclass(frozen=True)
class KVCacheGroups:
    sliding_window: int  # the widest sliding layer's window: no sliding layer loses a key it sees
    num_blocks: int  # the global layers' pool
    num_sliding_blocks: int  # the sliding layers' pool


def why_one_group(config: EngineConfig) -> str:
    """Why every layer shares one block table (""when groups may split): the paths that address a request's KV by
    one block table do not know groups yet."""
    if config.parallel_config.enable_dbo:
        return "dual-batch overlap (its micro-batches slice one block table)"
    if config.kv_transfer_config.kv_connector is not None:
        return "a KV connector (it sends and saves a request's blocks by one block table)"
    if config.speculative_config is not None:
        return "speculative decoding (drafts and a draft model's layers share the target's blocks)"
    if config.parallel_config.pipeline_parallel_size > 1:
        return "pipeline parallel (each stage holds its own mix of layers, the pools are sized for all of them)"
    return ""


def sliding_group_window(config: EngineConfig) -> int | None:
    """The sliding group's window where the KV cache splits in two groups, else None: a model whose layers all slide
    or all attend globally, or a path of why_one_group."""
    hf_config = config.model_info.hf_config
    if hf_config is None or why_one_group(config):
        return None
    windows = layer_sliding_windows(hf_config)
    sliding = [window for window in windows if window is not None]
    return max(sliding) if sliding and len(sliding) < len(windows) else None


def kv_cache_groups(config: EngineConfig, num_blocks: int) -> KVCacheGroups | None:
    """The split of a KV budget of `num_blocks` blocks of every layer, or None for one group (sliding_group_window).
    Every layer's block holds the same bytes (true of Gemma 2 / 3 and GPT-OSS), so the budget is counted in
    layer-blocks: the sliding pool takes what its running requests can hold at most, max_num_seqs *
    (ceil((window - 1 + max_num_batched_tokens) / block_size) + 1) (never more than num_blocks), the global pool the
    rest."""
    window = sliding_group_window(config)
    if window is None:
        return None
    assert config.model_info.hf_config is not None
    windows = layer_sliding_windows(config.model_info.hf_config)
    sliding = [w for w in windows if w is not None]
    num_global = len(windows) - len(sliding)
    block_size = config.cache_config.block_size
    scheduler = config.scheduler_config
    per_request = -(-(window - 1 + scheduler.max_num_batched_tokens) // block_size) + 1
    num_sliding_blocks = min(num_blocks, scheduler.max_num_seqs * per_request)
    num_global_blocks = (num_blocks * len(windows) - num_sliding_blocks * len(sliding)) // num_global
    return KVCacheGroups(window, num_global_blocks, num_sliding_blocks)
