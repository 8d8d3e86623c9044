"""Multi-head latent attention (DeepSeek-V2/V3's MLA) over raylm's paged KV cache, in torch (CPU and CUDA).

A layer's cache holds, per token, the normalised latent c_kv (kv_lora_rank) and the rotated rope key k_pe
(qk_rope_head_dim): [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim], not per-head keys and values. With
W_UK / W_UV the key and value halves of kv_b_proj ([heads, nope or v, kv_lora_rank]):

- prefill and chunks (query length > 1) expand the cached latents into per-head keys (k_nope | k_pe) and values
  through kv_b_proj and attend as ordinary multi-head attention;
- decodes use the absorbed form, as vLLM's MLA does: each head's q_nope is folded into W_UK (q_nope W_UK, of width
  kv_lora_rank), every head attends over the shared [latent | k_pe] keys with the latents as values (one key per
  token, read once for all heads), and the latent output leaves through W_UV.

The step's requests come from whatever backend built the metadata (its slot_mapping / block_table / query_start_loc /
seq_lens); they are grouped as the torch backend groups them (torch_backend.TorchAttentionBackend.build), once per step.
"""
from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F

from raylm.runner.attention.backend import AttentionBackend
from raylm.runner.attention.common import CommonAttentionMetadata, DecodeGraphBuffers
from raylm.runner.attention.kv_write import write_kv
from raylm.runner.attention.torch_backend import SDPAGroup, TorchAttentionBackend, TorchAttentionMetadata, attend
from raylm.runner.forward_context import get_forward_context
from raylm.runner.layers.attention import Attention


def kv_cache_shape(layer: Attention, backend: AttentionBackend, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """One layer's KV cache tensor: the backend's layout, or an MLA layer's own (latent and rope key per token)."""
    if isinstance(layer, MLAAttention):
        return (num_blocks, block_size, layer.head_size)
    return backend.get_kv_cache_shape(num_blocks, block_size, layer.num_kv_heads, layer.head_size)


class _StepPlan(threading.local):
    """The groups of the step being run (per thread: a dual-batch-overlap micro-batch runs in its own)."""

    metadata: Any = None
    plan: TorchAttentionMetadata | None = None


_step = _StepPlan()


def _uniform_decode_plan(slot_mapping: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                         block_size: int) -> TorchAttentionMetadata:
    """A captured uniform decode (one token per request, padding rows at slot -1): one decode group over the block
    table's full width, with no host read and no data-dependent shape."""
    num_reqs, max_blocks = block_table.shape
    key_pos = torch.arange(max_blocks * block_size, device=block_table.device)
    key_valid = key_pos < seq_lens[:, None].long()
    rows = torch.arange(num_reqs, device=block_table.device)
    group = SDPAGroup(True, rows[:, None], key_valid[:, None, None, :], False, None, rows, block_table, key_valid,
                      seq_lens[:, None].long() - 1, key_pos[None, :])
    return TorchAttentionMetadata(TorchAttentionBackend(), num_reqs, slot_mapping, [group])


def _common_metadata(metadata: Any) -> CommonAttentionMetadata:
    """The packed batch behind a backend's metadata (cpu and triton keep query_start_loc / seq_lens, flash_attn
    cumulative key lengths); the shapes of the groups are read on the host, once per step."""
    if hasattr(metadata, "cu_seqlens_k"):  # flash_attn
        query_start_loc, seq_lens = metadata.cu_seqlens_q, metadata.cu_seqlens_k.diff()
    else:
        query_start_loc, seq_lens = metadata.query_start_loc, metadata.seq_lens
    query_start_loc_cpu, seq_lens_cpu = query_start_loc.cpu(), seq_lens.cpu()
    num_reqs = seq_lens.shape[0]
    return CommonAttentionMetadata(
        query_start_loc, query_start_loc_cpu, seq_lens, seq_lens_cpu, metadata.block_table, metadata.slot_mapping,
        num_reqs, metadata.num_actual_tokens, int(query_start_loc_cpu.diff().max()), int(seq_lens_cpu.max()))


def step_plan(metadata: Any, block_size: int) -> TorchAttentionMetadata:
    """The torch backend's grouping of this step's requests (`metadata`: any backend's), built by the first MLA
    layer that asks."""
    if _step.metadata is not metadata:
        if isinstance(metadata, TorchAttentionMetadata):
            plan = metadata
        elif isinstance(buffers := getattr(metadata, "buffers", None), DecodeGraphBuffers):  # torch, flash_attn
            plan = _uniform_decode_plan(buffers.slot_mapping, buffers.seq_lens, buffers.block_table, block_size)
        elif metadata.slot_mapping.is_cuda and torch.cuda.is_current_stream_capturing():  # triton's graph decode
            plan = _uniform_decode_plan(metadata.slot_mapping, metadata.seq_lens, metadata.block_table, block_size)
        else:
            plan = TorchAttentionBackend().build(_common_metadata(metadata))
        _step.metadata, _step.plan = metadata, plan
    assert _step.plan is not None
    return _step.plan


class MLAAttention(Attention):
    """The attention op of one MLA layer (this rank's heads): forward(q, kv_c_normed, k_pe, kv_b_weight) writes the
    tokens' latent and rope key into the cache and returns [T, heads * v_head_dim]."""

    def __init__(self, num_heads: int, scale: float, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 kv_lora_rank: int, layer_idx: int) -> None:
        # One "KV head" of width kv_lora_rank + qk_rope_head_dim: what a token's cache entry holds.
        super().__init__(num_heads, kv_lora_rank + qk_rope_head_dim, scale, num_heads, layer_idx)
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = v_head_dim, kv_lora_rank

    def forward(self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,  # type: ignore[override]
                kv_b_weight: torch.Tensor) -> torch.Tensor:
        """q [T, heads, nope + rope] (rope part rotated), kv_c_normed [T, kv_lora_rank], k_pe [T, rope] (rotated),
        kv_b_weight [heads * (nope + v), kv_lora_rank] (this rank's rows of kv_b_proj) -> [T, heads * v]."""
        context = get_forward_context()
        metadata = context.attn_metadata
        if context.kv_connector is not None:
            raise ValueError("kv_connector: transferring an MLA layer's latent KV cache is not supported")
        new_kv = torch.cat([kv_c_normed, k_pe], dim=-1)  # [T, L + R]: a token's cache entry
        if metadata is None:  # dummy and profile runs: the batch as one causal sequence, no cache
            return self._attend_expanded(q[None], new_kv[None], None, True, kv_b_weight).flatten(1)
        assert self.kv_cache.numel() > 0, f"layer {self.layer_idx} has no KV cache bound"
        block_size = self.kv_cache.shape[1]
        plan = step_plan(metadata, block_size)
        cache = self.kv_cache.flatten(0, 1)  # [slots, L + R]
        lora = self.kv_lora_rank  # the latent goes in as write_kv's "key", the rope key as its "value"
        write_kv(cache[:, None, :lora], cache[:, None, lora:], plan.slot_mapping, kv_c_normed[:, None], k_pe[:, None])
        output = q.new_empty(q.shape[0], self.num_heads * self.v_head_dim)
        output[plan.num_actual_tokens:].zero_()  # padding rows
        for group in plan.groups:  # at most three kinds of request, not a loop over requests
            if group.block_table is None:  # fresh prompts: their own new entries
                keys = new_kv[group.query_index]
            else:
                slots = group.slots(block_size)
                keys = cache.index_select(0, slots.flatten()).unflatten(0, slots.shape)  # [B, S, L + R]
            mask = group.attn_mask
            if group.is_decode:
                rows = self._attend_absorbed(q[group.out_index], keys, mask, kv_b_weight)
            else:
                rows = self._attend_expanded(q[group.query_index], keys, mask, group.is_causal, kv_b_weight)
                rows = rows.flatten(0, 1)
            output.index_copy_(0, group.out_index, rows if group.out_rows is None else rows[group.out_rows])
        return output

    def _split_kv_b(self, kv_b_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [heads, nope, L] and W_UV [heads, v, L], views of kv_b_proj's weight."""
        w = kv_b_weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, :self.qk_nope_head_dim], w[:, self.qk_nope_head_dim:]

    def _attend_expanded(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
                         kv_b_weight: torch.Tensor) -> torch.Tensor:
        """q [B, Q, heads, nope + rope], keys [B, S, L + R] -> [B, Q, heads * v]: per-head K/V from the latents."""
        nope, lora = self.qk_nope_head_dim, self.kv_lora_rank
        kv = F.linear(keys[..., :lora], kv_b_weight).unflatten(-1, (self.num_heads, -1))  # [B, S, heads, nope + v]
        k_pe = keys[..., None, lora:].expand(-1, -1, self.num_heads, -1)
        k = torch.cat([kv[..., :nope], k_pe], dim=-1)
        out = attend(q.transpose(1, 2), k.transpose(1, 2), kv[..., nope:].transpose(1, 2), mask, is_causal,
                     self.scale)  # [B, heads, Q, v]
        return out.transpose(1, 2).flatten(2)

    def _attend_absorbed(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None,
                         kv_b_weight: torch.Tensor) -> torch.Tensor:
        """q [B, heads, nope + rope] (one query token per request), keys [B, S, L + R] -> [B, heads * v]: the heads
        are the query rows of one single-key-head attention over the latents."""
        w_uk, w_uv = self._split_kv_b(kv_b_weight)
        q_latent = torch.einsum("bhn,hnl->bhl", q[..., :self.qk_nope_head_dim], w_uk)
        q_cat = torch.cat([q_latent, q[..., self.qk_nope_head_dim:]], dim=-1)[:, None]  # [B, 1, heads, L + R]
        keys = keys[:, None]
        out = attend(q_cat, keys, keys[..., :self.kv_lora_rank], mask, False, self.scale)  # [B, 1, heads, L]
        return torch.einsum("bhl,hvl->bhv", out[:, 0], w_uv).flatten(1)

    def extra_repr(self) -> str:
        return (f"layer={self.layer_idx}, heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, "
                f"qk_rope_head_dim={self.qk_rope_head_dim}, qk_nope_head_dim={self.qk_nope_head_dim}, "
                f"v_head_dim={self.v_head_dim}")
