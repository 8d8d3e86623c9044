"""Reference attention over a paged KV cache in plain torch (CPU and GPU).

`build()` turns the packed varlen batch into at most three padded groups (1-token decodes, chunks with cached
context, and prompts with none) so that a batch of many decodes plus one long prefill pads neither to the other's
shape. Each group is one `scaled_dot_product_attention` call: decodes and chunks over K/V gathered from the cache
through slot indices computed once per step, fresh prompts over their own new K/V. No Python loop over requests runs
per layer, and nothing in `build()` or `forward()` reads a device value back to the host.

Inside a CUDA graph (`build_decode_graph`) a decode attends through `torch_paged_decode.packed_paged_decode`: the
blocks in use, packed to a fixed capacity, not batch x max_model_len keys.

A layer may pass a sliding window (a query sees its last `sliding_window` positions, itself included), a logit
soft-cap (scores become cap * tanh(scores / cap) before the softmax) and attention sinks (GPT-OSS: a learned logit per
query head joins each softmax's denominator). SDPA has neither of the last two: those layers score in float32 by hand.
The window's mask is built per group once per step, for the first layer that asks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from raylm.runner.attention.backend import AttentionBackend, AttentionCGSupport, AttentionMetadata
from raylm.runner.attention.common import CommonAttentionMetadata, DecodeGraphBuffers
from raylm.runner.attention.kv_write import write_kv
from raylm.runner.attention.torch_paged_decode import (
    blocks_attended,
    decode_capacity,
    packed_decode_bytes,
    packed_paged_decode,
)
from raylm.runner.host_sync import to_device

# Scores (float32) a soft-capped attention call holds at once: 256 MiB, whatever the prompt's length.
SCORE_CHUNK = 1 << 26


@dataclass
class SDPAGroup:
    """B requests padded to Q query rows and S key positions."""

    is_decode: bool  # every query is one token
    query_index: torch.Tensor  # [B, Q] packed token of each query row (padding rows repeat a real token)
    attn_mask: torch.Tensor | None  # [B, 1, Q, S] bool, True: attend; None when is_causal or nothing is masked
    is_causal: bool
    out_rows: torch.Tensor | None  # rows of the flattened [B*Q] output that are real tokens; None: all
    out_index: torch.Tensor  # packed token index of each real row
    # [B, max_blocks] block ids of the group's requests; None: the keys are the queries' own new K/V (fresh prompts)
    block_table: torch.Tensor | None
    key_valid: torch.Tensor | None  # [B, S] key position < seq_len (with block_table)
    # Absolute positions of the query rows ([B, Q], padding rows: the last real one's) and of the keys ([B or 1, S]):
    # what a sliding window compares.
    query_pos: torch.Tensor
    key_pos: torch.Tensor
    kv_slots: torch.Tensor | None = None  # [B, S] cache slot of each key (padding: slot 0); set by slots()
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # sliding_window -> mask; set by mask_for()

    def slots(self, block_size: int) -> torch.Tensor:
        assert self.block_table is not None and self.key_valid is not None
        if self.kv_slots is None:
            key_pos = torch.arange(self.key_valid.shape[1], device=self.key_valid.device)
            blocks = self.block_table[:, key_pos // block_size].long()
            self.kv_slots = torch.where(self.key_valid, blocks * block_size + key_pos % block_size, 0)
        return self.kv_slots

    def mask_for(self, sliding_window: int | None) -> torch.Tensor | None:
        """The group's mask ([B, 1, Q, S], True: attend), narrowed to the last `sliding_window` positions of each
        query; None where no key is masked."""
        if sliding_window is None:
            return self.attn_mask
        if sliding_window not in self.window_masks:
            mask = (self.key_pos[:, None, :] > self.query_pos[:, :, None] - sliding_window).unsqueeze(1)
            if self.is_causal:
                mask &= self.key_pos[:, None, None, :] <= self.query_pos[:, None, :, None]
            self.window_masks[sliding_window] = mask if self.attn_mask is None else mask & self.attn_mask
        return self.window_masks[sliding_window]


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    slot_mapping: torch.Tensor  # [num_actual_tokens] cache slot of each new token, -1: write nothing
    groups: list[SDPAGroup]
    # The block size arrives with the first layer's cache; the key slots computed then serve every layer.
    block_size: int | None = None


@dataclass
class DecodeGraphMetadata(AttentionMetadata):
    """The fixed-buffer decode (runner/attention/common.py, DecodeGraphBuffers): padding requests' K/V go to the
    scratch slot (an index_copy cannot skip rows inside a graph), their output is never read."""

    buffers: DecodeGraphBuffers


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE  # build_decode_graph

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def build(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        n = common.num_actual_tokens
        query_start_loc = common.query_start_loc_cpu[:common.num_reqs + 1]
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        is_decode = query_lens == 1
        is_fresh = ~is_decode & (query_lens == common.seq_lens_cpu[:common.num_reqs])
        groups = [self._build_group(common, reqs.nonzero().squeeze(1)) for reqs in (is_decode, ~is_decode & ~is_fresh)
                  if bool(reqs.any())]
        if bool(is_fresh.any()):
            groups.append(self._build_fresh_group(common, is_fresh.nonzero().squeeze(1)))
        return TorchAttentionMetadata(self, n, common.slot_mapping[:n], groups)

    @staticmethod
    def _build_group(common: CommonAttentionMetadata, reqs_cpu: torch.Tensor) -> SDPAGroup:
        """Requests whose keys are read from the cache (decodes, chunks with cached context); the shapes come from
        the CPU copies of the metadata."""
        device = common.block_table.device
        starts_cpu = common.query_start_loc_cpu[reqs_cpu]
        query_lens_cpu = common.query_start_loc_cpu[reqs_cpu + 1] - starts_cpu
        seq_lens_cpu = common.seq_lens_cpu[reqs_cpu]
        max_q, max_s = int(query_lens_cpu.max()), int(seq_lens_cpu.max())
        same_query_len = bool((query_lens_cpu == max_q).all())
        uniform = same_query_len and bool((seq_lens_cpu == max_s).all())
        reqs = to_device(reqs_cpu, device)
        starts = common.query_start_loc[reqs].long()
        query_lens = common.query_start_loc[reqs + 1].long() - starts
        seq_lens = common.seq_lens[reqs].long()

        key_pos = torch.arange(max_s, device=device)
        key_valid = key_pos < seq_lens[:, None]  # [B, S]
        row = torch.arange(max_q, device=device)
        query_index = starts[:, None] + torch.minimum(row, query_lens[:, None] - 1)
        query_pos = (seq_lens - query_lens)[:, None] + row  # absolute position of each query row
        last_pos = (seq_lens - query_lens)[:, None] + torch.minimum(row, query_lens[:, None] - 1)

        attn_mask = None
        if not (uniform and max_q == 1):
            # Padding rows see every valid key, so no row is fully masked (that would give NaN).
            attn_mask = ((key_pos <= query_pos[:, :, None]) & key_valid[:, None, :]).unsqueeze(1)
        out_rows, out_index = None, query_index.flatten()
        if not same_query_len:
            out_rows = to_device((torch.arange(max_q) < query_lens_cpu[:, None]).flatten().nonzero().squeeze(1), device)
            out_index = out_index[out_rows]
        return SDPAGroup(max_q == 1, query_index, attn_mask, False, out_rows, out_index, common.block_table[reqs],
                         key_valid, last_pos, key_pos[None, :])

    @staticmethod
    def _build_fresh_group(common: CommonAttentionMetadata, reqs_cpu: torch.Tensor) -> SDPAGroup:
        """Prompts with no cached context, attending over their own new K/V in one call: padded to the longest
        ([N, L], causal) or packed with a block-diagonal causal mask ([1, T]), whichever scores fewer pairs."""
        device = common.block_table.device
        starts = common.query_start_loc_cpu[reqs_cpu].long()
        lens = common.query_start_loc_cpu[reqs_cpu + 1].long() - starts
        num_prompts, longest, total = len(lens), int(lens.max()), int(lens.sum())
        same_len = bool((lens == longest).all())
        if same_len or num_prompts * longest * longest <= total * total:
            row = torch.arange(longest)
            query_index_cpu = starts[:, None] + torch.minimum(row, lens[:, None] - 1)
            query_index = to_device(query_index_cpu, device)
            key = torch.arange(longest, device=device)
            query_pos = query_index - to_device(starts, device)[:, None]  # a fresh prompt's positions start at 0
            if same_len:
                return SDPAGroup(False, query_index, None, True, None, query_index.flatten(), None, None, query_pos,
                                 key[None, :])
            lens_d = to_device(lens, device)
            # Key j is seen by query row i when j <= i and j is a real token: padding rows see the whole prompt.
            mask = ((key[None, None, :] <= key[None, :, None]) & (key < lens_d[:, None, None])).unsqueeze(1)
            real_rows = (row < lens[:, None]).flatten()
            return SDPAGroup(False, query_index, mask, False, to_device(real_rows.nonzero().squeeze(1), device),
                             to_device(query_index_cpu.flatten()[real_rows], device), None, None, query_pos,
                             key[None, :])
        prompt = torch.arange(num_prompts).repeat_interleave(lens)
        position = torch.arange(total) - (lens.cumsum(0) - lens).repeat_interleave(lens)
        tokens = to_device(starts.repeat_interleave(lens) + position, device)
        prompt_d, position_d = to_device(prompt, device), to_device(position, device)
        mask = (prompt_d[None, :] == prompt_d[:, None]) & (position_d[None, :] <= position_d[:, None])
        return SDPAGroup(False, tokens[None, :], mask[None, None], False, None, tokens, None, None, position_d[None, :],
                         position_d[None, :])

    def build_decode_graph(self, buffers: DecodeGraphBuffers) -> DecodeGraphMetadata:
        assert buffers.scratch_slot >= 0, "the torch backend's fixed-buffer decode writes padding to a scratch slot"
        return DecodeGraphMetadata(self, buffers.slot_mapping.shape[0], buffers)

    def decode_graph_fits(self, seq_lens_cpu: torch.Tensor, num_reqs_padded: int, kv_cache: torch.Tensor,
                          max_blocks_per_req: int) -> bool:
        """Whether the packed decode's capacity holds the batch: always, unless requests share prefix blocks."""
        block_size, num_cache_blocks = kv_cache.shape[2], kv_cache.shape[1]
        needed = blocks_attended(seq_lens_cpu, block_size) + num_reqs_padded - len(seq_lens_cpu)
        return needed <= decode_capacity(num_reqs_padded, max_blocks_per_req, num_cache_blocks)

    def decode_graph_bytes(self, num_reqs: int, max_keys: int, num_heads: int, num_kv_heads: int, head_size: int,
                           element_size: int, block_size: int) -> int:
        """The packed decode over full block tables: num_reqs x max_keys keys. Once the KV cache is known the capacity
        is min(that, the cache plus one block per request), which this estimate, taken before the cache is sized,
        cannot use."""
        return packed_decode_bytes(num_reqs * -(-max_keys // block_size), block_size, num_heads, num_kv_heads,
                                   head_size, element_size)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float, sliding_window: int | None = None,
                logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(metadata, DecodeGraphMetadata):
            return self._forward_decode_graph(query, key, value, kv_cache, metadata, scale, sliding_window,
                                              logits_soft_cap, sinks)
        assert isinstance(metadata, TorchAttentionMetadata)
        block_size = kv_cache.shape[2]
        if metadata.block_size is None:
            metadata.block_size = block_size
        assert metadata.block_size == block_size, "every layer's KV cache must have the same block size"
        num_tokens, num_heads, head_size = query.shape
        n = metadata.num_actual_tokens
        key_cache, value_cache = kv_cache[0].flatten(0, 1), kv_cache[1].flatten(0, 1)  # [slots, kv_heads, D]
        write_kv(key_cache, value_cache, metadata.slot_mapping, key, value)

        output = query.new_empty(num_tokens, num_heads * head_size)
        output[n:].zero_()
        for group in metadata.groups:  # at most three: a loop over kinds of request, not over requests
            if group.block_table is None:  # fresh prompts: their own new K/V
                k, v = (t[group.query_index].transpose(1, 2) for t in (key, value))  # [B, KV, S, D]
            else:
                kv_slots = group.slots(block_size)
                k = key_cache.index_select(0, kv_slots.flatten()).unflatten(0, kv_slots.shape).transpose(1, 2)
                v = value_cache.index_select(0, kv_slots.flatten()).unflatten(0, kv_slots.shape).transpose(1, 2)
            mask = group.mask_for(sliding_window)
            is_causal = group.is_causal and sliding_window is None
            if group.is_decode:
                # The query heads sharing a KV head become rows of one [G, D] query: K/V are read once per KV head.
                q = query[group.out_index].unflatten(1, (k.shape[1], -1))  # [B, KV, G, D]
                row_sinks = None if sinks is None else sinks.view(1, k.shape[1], -1, 1)  # a sink per [KV, G] row
                o = attend(q, k, v, mask, False, scale, logits_soft_cap, row_sinks).flatten(1)
            else:
                q = query[group.query_index].transpose(1, 2)  # [B, H, Q, D]
                o = attend(q, k, v, mask, is_causal, scale, logits_soft_cap,
                           None if sinks is None else sinks.view(1, -1, 1, 1))
                o = o.transpose(1, 2).reshape(-1, num_heads * head_size)
            output.index_copy_(0, group.out_index, o if group.out_rows is None else o[group.out_rows])
        return output

    @staticmethod
    def _forward_decode_graph(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                              metadata: DecodeGraphMetadata, scale: float, sliding_window: int | None,
                              logits_soft_cap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
        """No host read and no data-dependent shape: the new K/V go in through an index_copy (padding to the scratch
        slot), then each request attends over its blocks, packed to the capacity of this batch size."""
        buffers = metadata.buffers
        key_cache, value_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, KV, D]
        slots = torch.where(buffers.slot_mapping >= 0, buffers.slot_mapping, buffers.scratch_slot)
        key_cache.flatten(0, 1).index_copy_(0, slots, key)
        value_cache.flatten(0, 1).index_copy_(0, slots, value)
        num_reqs, max_blocks = buffers.block_table.shape
        capacity = decode_capacity(num_reqs, max_blocks, key_cache.shape[0])
        return packed_paged_decode(query, key_cache, value_cache, buffers.block_table, buffers.seq_lens, scale,
                                   capacity, sliding_window, logits_soft_cap, sinks)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool, scale: float,
           logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, Q, D], k/v [B, KV, S, D] (H a multiple of KV), mask broadcastable to [B, H, Q, S] (True: attend) ->
    [B, H, Q, D]. SDPA, unless the scores are soft-capped or have sinks (broadcastable to [B, H, Q, 1]): then in
    float32 by hand, as transformers' eager attention (the cap applies to the scaled scores, before the mask; a sink
    is one more logit in the softmax, whose weight is dropped), SCORE_CHUNK query rows' scores at a time at most."""
    if logits_soft_cap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1).float(), v.repeat_interleave(group, dim=1).float()
    rows = max(1, SCORE_CHUNK // (q.shape[0] * q.shape[1] * k.shape[2]))
    outputs = []
    for start in range(0, q.shape[2], rows):
        chunk = q[:, :, start:start + rows].float()
        scores = torch.matmul(chunk, k.transpose(-1, -2))
        if logits_soft_cap is None:
            scores.mul_(scale)
        else:
            scores.mul_(scale / logits_soft_cap).tanh_().mul_(logits_soft_cap)
        if is_causal:  # a fresh prompt's own keys (Q == S): row i sees keys 0..i
            row = torch.arange(start, start + chunk.shape[2], device=q.device)
            scores.masked_fill_(torch.arange(k.shape[2], device=q.device) > row[:, None], float("-inf"))
        elif mask is not None:
            scores.masked_fill_(~mask[..., start:start + rows, :] if mask.shape[-2] > 1 else ~mask, float("-inf"))
        if sinks is None:
            outputs.append(torch.matmul(scores.softmax(dim=-1), v))
            continue
        row_sinks = sinks[..., start:start + rows, :] if sinks.shape[-2] > 1 else sinks
        logits = torch.cat([scores, row_sinks.float().expand(*scores.shape[:-1], 1)], dim=-1)
        outputs.append(torch.matmul(logits.softmax(dim=-1)[..., :-1], v))
    return torch.cat(outputs, dim=2).to(q.dtype)
