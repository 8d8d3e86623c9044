"""Writing new K/V into a paged cache through a slot mapping whose -1 entries write nothing, with no host read.

Selecting the rows to write (a boolean mask, nonzero) reads their count back to the host: on CUDA a sync per layer.
Instead every row is written: a row with slot -1 writes, to the slot of the first row that has one, the very values
that row writes (with no such row, slot 0's own contents back to slot 0). Duplicate indices then carry equal values,
so the order the writes land in does not matter.
"""
from __future__ import annotations

import torch


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor) -> None:
    """key/value_cache [num_slots, KV, D] (flat views of the cache); slot_mapping [n] (-1: write nothing);
    key/value [>= n, KV, D], rows past n ignored."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    written = slot_mapping >= 0
    # A one-element index tensor, not a 0-d one: indexing with a 0-d tensor reads it back to the host (.item()).
    first = written.to(torch.uint8).argmax().view(1)  # 0 when no row is written
    any_written = written.index_select(0, first)
    fallback_slot = torch.where(any_written, slot_mapping.index_select(0, first), 0)
    slots = torch.where(written, slot_mapping, fallback_slot)
    for cache, new in ((key_cache, key[:n]), (value_cache, value[:n])):
        fallback = torch.where(any_written[:, None, None], new.index_select(0, first),
                               cache.index_select(0, fallback_slot))
        cache.index_copy_(0, slots, torch.where(written[:, None, None], new, fallback))
