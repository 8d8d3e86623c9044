"""Reference attention over a paged KV cache in plain torch (CPU and GPU).

`build()` turns the packed varlen batch into at most two padded groups (1-token decodes, and the rest) so that
a batch of many decodes plus one long prefill pads neither to the other's shape. Each group is one
`scaled_dot_product_attention` call over K/V gathered from the cache through slot indices computed once per
step; no Python loop over requests runs per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raylm.runner.attention.backend import AttentionBackend, AttentionCGSupport, AttentionMetadata
from raylm.runner.attention.common import CommonAttentionMetadata, DecodeGraphBuffers


@dataclass
class SDPAGroup:
    """B requests padded to Q query rows and S key positions."""

    is_decode: bool  # every query is one token
    query_index: torch.Tensor  # [B, Q] packed token of each query row (padding rows repeat a real token)
    attn_mask: torch.Tensor | None  # [B, 1, Q, S] bool, True: attend; None when is_causal or nothing is masked
    is_causal: bool
    out_rows: torch.Tensor | None  # rows of the flattened [B*Q] output that are real tokens; None: all
    out_index: torch.Tensor  # packed token index of each real row
    block_table: torch.Tensor  # [B, max_blocks] block ids of the group's requests
    key_valid: torch.Tensor  # [B, S] key position < seq_len
    kv_slots: torch.Tensor | None = None  # [B, S] cache slot of each key (padding: slot 0); set by slots()

    def slots(self, block_size: int) -> torch.Tensor:
        if self.kv_slots is None:
            key_pos = torch.arange(self.key_valid.shape[1], device=self.key_valid.device)
            blocks = self.block_table[:, key_pos // block_size].long()
            self.kv_slots = torch.where(self.key_valid, blocks * block_size + key_pos % block_size, 0)
        return self.kv_slots


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    write_slots: torch.Tensor  # cache slots that receive new K/V
    write_tokens: torch.Tensor | None  # packed tokens written to write_slots; None: tokens 0..len-1
    groups: list[SDPAGroup]
    # (first token, length) of each prompt with no cached context: plain causal attention over its own
    # new K/V, one SDPA call each, so prompts of different lengths are not padded to the longest.
    fresh_prompts: list[tuple[int, int]]
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
        slots = common.slot_mapping[:n]
        valid = slots >= 0
        write_tokens = None
        if not bool(valid.all()):
            write_tokens = valid.nonzero().squeeze(1)
            slots = slots[write_tokens]
        query_start_loc = common.query_start_loc_cpu[:common.num_reqs + 1]
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        is_decode = query_lens == 1
        is_fresh = ~is_decode & (query_lens == common.seq_lens_cpu[:common.num_reqs])
        fresh = is_fresh.nonzero().squeeze(1)
        fresh_prompts = list(zip(query_start_loc[fresh].tolist(), query_lens[fresh].tolist()))
        groups = [self._build_group(common, reqs.nonzero().squeeze(1)) for reqs in (is_decode, ~is_decode & ~is_fresh)
                  if bool(reqs.any())]
        return TorchAttentionMetadata(self, n, slots, write_tokens, groups, fresh_prompts)

    @staticmethod
    def _build_group(common: CommonAttentionMetadata, reqs_cpu: torch.Tensor) -> SDPAGroup:
        device = common.block_table.device
        starts_cpu = common.query_start_loc_cpu[reqs_cpu]
        query_lens_cpu = common.query_start_loc_cpu[reqs_cpu + 1] - starts_cpu
        seq_lens_cpu = common.seq_lens_cpu[reqs_cpu]
        max_q, max_s = int(query_lens_cpu.max()), int(seq_lens_cpu.max())
        same_query_len = bool((query_lens_cpu == max_q).all())
        uniform = same_query_len and bool((seq_lens_cpu == max_s).all())
        reqs = reqs_cpu.to(device, non_blocking=True)
        starts = common.query_start_loc[reqs].long()
        query_lens = common.query_start_loc[reqs + 1].long() - starts
        seq_lens = common.seq_lens[reqs].long()

        key_pos = torch.arange(max_s, device=device)
        key_valid = key_pos < seq_lens[:, None]  # [B, S]
        row = torch.arange(max_q, device=device)
        query_index = starts[:, None] + torch.minimum(row, query_lens[:, None] - 1)
        query_pos = (seq_lens - query_lens)[:, None] + row  # absolute position of each query row

        attn_mask, is_causal = None, False
        if uniform and max_q == max_s and max_q > 1:
            is_causal = True  # prompts without cached context: plain causal attention
        elif not (uniform and max_q == 1):
            # Padding rows see every valid key, so no row is fully masked (that would give NaN).
            attn_mask = ((key_pos <= query_pos[:, :, None]) & key_valid[:, None, :]).unsqueeze(1)
        out_rows = None if same_query_len else (row < query_lens[:, None]).flatten().nonzero().squeeze(1)
        out_index = query_index.flatten() if out_rows is None else query_index.flatten()[out_rows]
        return SDPAGroup(max_q == 1, query_index, attn_mask, is_causal, out_rows, out_index,
                         common.block_table[reqs], key_valid)

    def build_decode_graph(self, buffers: DecodeGraphBuffers) -> DecodeGraphMetadata:
        assert buffers.scratch_slot >= 0, "the torch backend's fixed-buffer decode writes padding to a scratch slot"
        return DecodeGraphMetadata(self, buffers.slot_mapping.shape[0], buffers)

    def decode_graph_bytes(self, num_reqs: int, max_keys: int, num_heads: int, num_kv_heads: int, head_size: int,
                           element_size: int) -> int:
        """K/V gathered over the whole block-table width, their scores and key slots."""
        return num_reqs * max_keys * (2 * num_kv_heads * head_size * element_size + 4 * num_heads + 8)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        if isinstance(metadata, DecodeGraphMetadata):
            return self._forward_decode_graph(query, key, value, kv_cache, metadata, scale)
        assert isinstance(metadata, TorchAttentionMetadata)
        block_size = kv_cache.shape[2]
        if metadata.block_size is None:
            metadata.block_size = block_size
        assert metadata.block_size == block_size, "every layer's KV cache must have the same block size"
        num_tokens, num_heads, head_size = query.shape
        n = metadata.num_actual_tokens
        key_cache, value_cache = kv_cache[0].flatten(0, 1), kv_cache[1].flatten(0, 1)  # [slots, kv_heads, D]
        new_key, new_value = key[:n], value[:n]
        if metadata.write_tokens is not None:
            new_key, new_value = new_key[metadata.write_tokens], new_value[metadata.write_tokens]
        key_cache.index_copy_(0, metadata.write_slots, new_key)
        value_cache.index_copy_(0, metadata.write_slots, new_value)

        output = query.new_empty(num_tokens, num_heads * head_size)
        output[n:].zero_()
        for start, length in metadata.fresh_prompts:
            q, k, v = (t[start : start + length].transpose(0, 1) for t in (query, key, value))  # [heads, L, D]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            output[start : start + length] = o.transpose(0, 1).reshape(length, num_heads * head_size)
        for group in metadata.groups:
            kv_slots = group.slots(block_size)
            k = key_cache.index_select(0, kv_slots.flatten()).unflatten(0, kv_slots.shape).transpose(1, 2)
            v = value_cache.index_select(0, kv_slots.flatten()).unflatten(0, kv_slots.shape).transpose(1, 2)
            if group.is_decode:
                # The query heads sharing a KV head become rows of one [G, D] query: K/V are read once per KV head.
                q = query[group.out_index].unflatten(1, (k.shape[1], -1))  # [B, KV, G, D]
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=group.attn_mask, scale=scale)
                o = o.flatten(1)
            else:
                q = query[group.query_index].transpose(1, 2)  # [B, H, Q, D]
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=group.attn_mask, is_causal=group.is_causal,
                                                   scale=scale, enable_gqa=True)
                o = o.transpose(1, 2).reshape(-1, num_heads * head_size)
            output.index_copy_(0, group.out_index, o if group.out_rows is None else o[group.out_rows])
        return output

    @staticmethod
    def _forward_decode_graph(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                              metadata: DecodeGraphMetadata, scale: float) -> torch.Tensor:
        """No host sync and no data-dependent shape: every request attends over the whole block-table width, masked
        at its seq_len. Costs B * max_model_len keys per layer: the price of a graph-safe plain-torch decode."""
        buffers = metadata.buffers
        block_size = kv_cache.shape[2]
        key_cache, value_cache = kv_cache[0].flatten(0, 1), kv_cache[1].flatten(0, 1)
        slots = torch.where(buffers.slot_mapping >= 0, buffers.slot_mapping, buffers.scratch_slot)
        key_cache.index_copy_(0, slots, key)
        value_cache.index_copy_(0, slots, value)
        num_reqs, num_kv_heads = query.shape[0], key.shape[1]
        key_pos = torch.arange(buffers.block_table.shape[1] * block_size, device=query.device)
        kv_slots = buffers.block_table[:, key_pos // block_size].long() * block_size + key_pos % block_size
        k = key_cache.index_select(0, kv_slots.flatten()).unflatten(0, kv_slots.shape).transpose(1, 2)
        v = value_cache.index_select(0, kv_slots.flatten()).unflatten(0, kv_slots.shape).transpose(1, 2)
        # Key 0 stays visible even at seq_len 0: a fully masked row would give NaN.
        mask = key_pos < buffers.seq_lens.clamp(min=1)[:, None]
        q = query.unflatten(1, (num_kv_heads, -1))  # [B, KV, G, D]: K/V read once per KV head
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=scale)
        return o.reshape(num_reqs, -1)
