"""One query token per request attending over its paged K/V in plain torch, with static shapes and no host read: the
torch backend's decode inside a CUDA graph.

The blocks the batch attends to are packed, request after request (request r's first ceil(seq_len / block_size) block
table entries), into a list of fixed length `capacity`; each packed block is gathered once and scored against its
request's query. Softmax runs per request across its blocks: the request's max by a scatter max (exact in any order),
then the exponentials' and weighted values' sums by a float64 prefix sum read at the requests' ends (no atomic adds:
the same batch gives the same bits every replay). Memory and work follow `capacity`, the blocks in use (the KV cache
plus one block per request bounds them, prefix sharing aside), not batch x max_model_len; a batch that attends to
more blocks than that runs eagerly (`decode_graph_fits`).
"""
from __future__ import annotations

import torch


def packed_decode_bytes(num_blocks: int, block_size: int, num_heads: int, num_kv_heads: int, head_size: int,
                        element_size: int) -> int:
    """Memory one layer's packed decode over `num_blocks` packed blocks allocates, at most: the gathered K then V
    (cache dtype, then float32), the per-block queries, scores and weights, and the float64 prefix sums."""
    gathered = block_size * num_kv_heads * head_size * (element_size + 4)
    per_block = 2 * gathered + 2 * num_heads * head_size * 4 + 2 * num_heads * block_size * 4
    return num_blocks * (per_block + 4 * num_heads * (head_size + 1) * 8)


def decode_capacity(num_reqs: int, max_blocks_per_req: int, num_cache_blocks: int) -> int:
    """Packed blocks a decode graph of `num_reqs` requests holds: every block of the KV cache plus one per request
    (padding requests read one block each), and never more than num_reqs full block tables."""
    return min(num_reqs * max_blocks_per_req, num_cache_blocks + num_reqs)


def blocks_attended(seq_lens: torch.Tensor, block_size: int) -> int:
    """Blocks a decode batch reads, from its seq_lens (a CPU tensor: no device read); seq_len 0 counts one block."""
    return int(((seq_lens.clamp(min=1) + block_size - 1) // block_size).sum())


def packed_paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, capacity: int,
                        sliding_window: int | None = None, logits_soft_cap: float | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """query [B, H, D]; key/value_cache [num_blocks, block_size, KV, D]; block_table [B, W]; seq_lens [B] ->
    [B, H * D]. A seq_len of 0 (a stale padding row) attends to its first key, so every output is finite. With a
    sliding window a query sees its last `sliding_window` keys; a soft-cap maps scores to cap * tanh(score / cap);
    sinks [H], one logit per head, join each request's max and its softmax's denominator."""
    num_reqs, num_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    device = query.device
    seq_lens = seq_lens.long().clamp(min=1)
    num_blocks = (seq_lens + block_size - 1) // block_size
    ends = num_blocks.cumsum(0)  # request r owns packed blocks [ends[r] - num_blocks[r], ends[r])
    packed = torch.arange(capacity, device=device)
    owner = torch.searchsorted(ends, packed, right=True).clamp_(max=num_reqs - 1)
    column = (packed - (ends - num_blocks)[owner]).clamp_(0, block_table.shape[1] - 1)
    in_use = packed < ends[-1]
    blocks = block_table[owner, column].long()
    key_pos = column[:, None] * block_size + torch.arange(block_size, device=device)
    visible = in_use[:, None] & (key_pos < seq_lens[owner, None])  # [P, block_size]
    if sliding_window is not None:
        visible &= key_pos >= seq_lens[owner, None] - sliding_window

    # Scores and sums in float32 (as SDPA keeps them); K is dropped before V is gathered, to halve the peak.
    q = query.float().unflatten(1, (num_kv_heads, -1))[owner]  # [P, KV, G, D]: K/V read once per KV head
    scores = torch.einsum("pkgd,pskd->pkgs", q, key_cache.index_select(0, blocks).float()).mul_(scale)
    if logits_soft_cap is not None:
        scores.div_(logits_soft_cap).tanh_().mul_(logits_soft_cap)
    scores.masked_fill_(~visible[:, None, None, :], float("-inf"))
    block_max = scores.amax(dim=-1)  # [P, KV, G]
    request_max = block_max.new_full((num_reqs, *block_max.shape[1:]), float("-inf"))
    head_sinks = None if sinks is None else sinks.float().view(num_kv_heads, -1)  # [KV, G]
    if head_sinks is not None:
        request_max = torch.maximum(request_max, head_sinks)
    request_max.scatter_reduce_(0, owner[:, None, None].expand_as(block_max), block_max, "amax")
    weights = (scores - request_max[owner][..., None]).exp_()  # 0 at masked keys
    numerators = torch.einsum("pkgs,pskd->pkgd", weights, value_cache.index_select(0, blocks).float())
    denominators = _segment_sums(weights.sum(dim=-1), ends)
    if head_sinks is not None:
        denominators = denominators + (head_sinks - request_max).exp()
    out = _segment_sums(numerators, ends) / denominators[..., None]
    return out.to(query.dtype).reshape(num_reqs, num_heads * head_size)


def _segment_sums(values: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Sums of the packed rows of each request ([P, ...] -> [B, ...]), from a float64 prefix sum: deterministic, and
    its cancellation error (~1e-16 of the whole batch's sum) stays far below float32's rounding."""
    prefix = values.double().cumsum(0)
    prefix = torch.cat([prefix.new_zeros(1, *prefix.shape[1:]), prefix])
    ends = ends.clamp(max=values.shape[0])  # a batch past the capacity reads wrong sums, never out of bounds
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    return (prefix[ends] - prefix[starts]).float()
