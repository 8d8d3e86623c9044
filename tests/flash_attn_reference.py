"""The two flash-attn 2 calls the flash_attn backend makes, in plain torch after flash-attn's documented semantics
(paged K/V read through `block_table`, a causal mask aligned to the end of the keys), so that the backend's own logic
(cache writes through slot_mapping, the scratch slot, the fixed decode buffers, the metadata it passes) runs on CPU.
It says nothing about the CUDA kernels themselves: tests/test_attention_flash.py and scripts/gpu_check.py compare
those with the torch backend on a GPU."""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F


def _attend(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, blocks: torch.Tensor, num_keys: int,
            scale: float) -> torch.Tensor:
    """q [Q, H, D], the first num_keys keys read through one request's blocks -> [Q, H, D]; query i is at position
    num_keys - Q + i and sees the keys up to it."""
    page = key_cache.shape[1]
    positions = torch.arange(num_keys)
    slots = blocks[positions // page].long() * page + positions % page
    k = key_cache.flatten(0, 1)[slots].transpose(0, 1)  # [KV, S, D]
    v = value_cache.flatten(0, 1)[slots].transpose(0, 1)
    num_queries = q.shape[0]
    mask = positions[None, :] <= (num_keys - num_queries + torch.arange(num_queries))[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                           softmax_scale: float, causal: bool, block_table: torch.Tensor) -> torch.Tensor:
    assert causal, "the backend asks for causal attention"
    assert int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) <= max_seqlen_q
    assert int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max()) <= max_seqlen_k
    out = torch.empty_like(q)
    for r in range(block_table.shape[0]):
        start, end = int(cu_seqlens_q[r]), int(cu_seqlens_q[r + 1])
        num_keys = int(cu_seqlens_k[r + 1] - cu_seqlens_k[r])
        out[start:end] = _attend(q[start:end], k, v, block_table[r], num_keys, softmax_scale)
    return out


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                            cache_seqlens: torch.Tensor, block_table: torch.Tensor, softmax_scale: float,
                            causal: bool) -> torch.Tensor:
    assert causal and cache_seqlens.dtype == torch.int32 and block_table.dtype == torch.int32
    out = torch.empty_like(q)  # [B, Q, H, D]
    for r in range(q.shape[0]):
        out[r] = _attend(q[r], k_cache, v_cache, block_table[r], int(cache_seqlens[r]), softmax_scale)
    return out


def as_module() -> types.ModuleType:
    """A stand-in `flash_attn` module for sys.modules."""
    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = flash_attn_varlen_func  # type: ignore[attr-defined]
    module.flash_attn_with_kvcache = flash_attn_with_kvcache  # type: ignore[attr-defined]
    return module
