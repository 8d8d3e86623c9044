"""Copies of KV blocks between a layer's paged KV cache and contiguous tensors (sent on a direct channel) or host
arrays (what goes into Ray's object store).

Every attention backend keeps a layer's cache as one tensor whose dim 1 is the block (`[2, num_blocks, ...]`, the rest
in the backend's own layout), so a block copies as `kv[:, block_id]` whatever that layout is; both ends of a copy run
the same backend. Arrays hold the raw bits (an integer dtype of the element's size): numpy has no bfloat16.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def select_blocks(kv_layer: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """[2, len(block_ids), ...] contiguous copy of those blocks of one layer, on the cache's device."""
    return kv_layer.index_select(1, torch.tensor(block_ids, dtype=torch.long, device=kv_layer.device))


def gather_layer(kv_layer: torch.Tensor, block_ids: list[int]) -> np.ndarray:
    """[2, len(block_ids), ...] host copy of those blocks of one layer."""
    blocks = select_blocks(kv_layer, block_ids)
    return blocks.view(_BITS[blocks.element_size()]).cpu().numpy()


def gather_blocks(kv_caches: list[torch.Tensor], block_ids: list[int]) -> np.ndarray:
    """[num_layers, 2, len(block_ids), ...] host copy of those blocks of every layer."""
    return np.stack([gather_layer(kv_layer, block_ids) for kv_layer in kv_caches])


def scatter_layer(kv_layer: torch.Tensor, block_ids: list[int], blocks: np.ndarray) -> None:
    """Write blocks [2, len(block_ids), ...] (gather_layer's bits) into those blocks of one layer."""
    with warnings.catch_warnings():  # arrays from the object store are read-only; they are only read here
        warnings.simplefilter("ignore", UserWarning)
        source = torch.from_numpy(blocks)
    write_blocks(kv_layer, block_ids, source.to(kv_layer.device).view(kv_layer.dtype))


def write_blocks(kv_layer: torch.Tensor, block_ids: list[int], source: torch.Tensor) -> None:
    """Write source [2, len(block_ids), ...] (select_blocks' shape, on the cache's device) into those blocks."""
    if source.shape[1:] != (len(block_ids), *kv_layer.shape[2:]) or source.shape[0] != kv_layer.shape[0]:
        raise ValueError(f"KV blocks of shape {tuple(source.shape)} do not fit {len(block_ids)} blocks of a cache "
                         f"of shape {tuple(kv_layer.shape)}")
    kv_layer.index_copy_(1, torch.tensor(block_ids, dtype=torch.long, device=kv_layer.device), source)
