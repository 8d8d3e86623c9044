"""Triton kernels of the `triton` attention backend over the torch backend's KV cache layout
[2, num_blocks, block_size, num_kv_heads, head_size].

`write_kv` stores each token's new K/V in its `slot_mapping` slot. `paged_attention` is one varlen kernel for any
mix of prompts, chunks with context and decodes: a program owns BLOCK_Q query tokens of one request and one KV head,
i.e. BLOCK_M = BLOCK_Q * (heads per KV head) rows, so GQA reads each key once per KV head. It finds its request by a
binary search over `query_start_loc` and its keys through the block table, so it reads only the metadata tensors:
a CUDA graph replaying it sees whatever batch those tensors hold.

Whether `@triton.jit` builds a GPU kernel or an interpreted one (`TRITON_INTERPRET=1`, CPU tensors) is fixed when
this module is imported.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def write_kv(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
             stride_kt, stride_kh, stride_vt, stride_vh,
             stride_cb, stride_cs, stride_ch,
             block_size, num_kv_heads, head_size,
             KV_HEADS_P2: tl.constexpr, HEAD_P2: tl.constexpr):
    """One program per token: key/value[t] -> cache[slot // block_size, slot % block_size]; slot -1 writes nothing.
    Both cache halves share their strides (views of one tensor)."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, KV_HEADS_P2)[:, None]
    dims = tl.arange(0, HEAD_P2)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_size)
    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    cache_offset = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + heads * stride_ch + dims
    tl.store(key_cache_ptr + cache_offset, k, mask=mask)
    tl.store(value_cache_ptr + cache_offset, v, mask=mask)


@triton.jit
def _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q: tl.constexpr):
    """The request that owns global query block `q_block`: request r's blocks start at qsl[r] // BLOCK_Q + r, an
    upper bound of the blocks before it, so the launch grid needs no host-side count of blocks per request."""
    # Typed: older Triton rejects a loop-carried variable that starts as a constant (an int argument of 1 is one).
    lo: tl.int32 = 0
    hi: tl.int32 = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def paged_attention(out_ptr, query_ptr, key_cache_ptr, value_cache_ptr, block_table_ptr, seq_lens_ptr,
                    query_start_loc_ptr, sinks_ptr, scale, num_reqs,
                    stride_ot, stride_qt, stride_qh,
                    stride_cb, stride_cs, stride_ch, stride_bt,
                    block_size, head_size, sliding_window, soft_cap,
                    QUERIES_PER_KV: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                    TILE_N: tl.constexpr, HEAD_P2: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    SLIDING: tl.constexpr, SOFT_CAP: tl.constexpr, SINKS: tl.constexpr):
    """Causal attention of BLOCK_Q query tokens (all QUERIES_PER_KV heads of KV head program_id(1)) over keys
    0..context+i of their request (SLIDING: only the last `sliding_window` of them; SOFT_CAP: scores mapped to
    soft_cap * tanh(score / soft_cap); SINKS: each head's logit at sinks_ptr joins its softmax's denominator),
    TILE_N keys at a time, with an online softmax in float32."""
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    first = (q_block - (q_start // BLOCK_Q + req)) * BLOCK_Q  # this block's first query of the request
    if first >= query_len:  # the grid over-counts: spare programs exit
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    q_index = first + rows // QUERIES_PER_KV  # query of each row within its request
    head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_valid = (rows // QUERIES_PER_KV < BLOCK_Q) & (q_index < query_len)
    dims = tl.arange(0, HEAD_P2)
    dim_valid = dims < head_size
    token = (q_start + q_index).to(tl.int64)
    q = tl.load(query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    key_limit = context_len + q_index  # each row's last visible key position (causal)

    if SINKS:  # the online softmax starts from the sink: its max, and its exp(0) = 1 in the sum
        m_i = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_P2], dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634  # exp2 instead of exp: log2(e)
    num_keys = tl.minimum(context_len + first + BLOCK_Q, seq_len)
    lowest: tl.int32 = 0
    if SLIDING:  # skip the tiles every row's window has left
        lowest = tl.maximum(context_len + first - sliding_window + 1, 0) // TILE_N * TILE_N
    for tile_start in range(lowest, num_keys, TILE_N):
        pos = tile_start + tl.arange(0, TILE_N)
        key_valid = pos < num_keys
        block = tl.load(block_table_ptr + req * stride_bt + pos // block_size, mask=key_valid, other=0).to(tl.int64)
        kv_offset = block * stride_cb + (pos % block_size) * stride_cs + kv_head * stride_ch  # [TILE_N]
        k_mask, v_mask = dim_valid[:, None] & key_valid[None, :], key_valid[:, None] & dim_valid[None, :]
        k = tl.load(key_cache_ptr + kv_offset[None, :] + dims[:, None], mask=k_mask, other=0.0)  # [HEAD_P2, TILE_N]
        v = tl.load(value_cache_ptr + kv_offset[:, None] + dims[None, :], mask=v_mask, other=0.0)  # [TILE_N, HEAD_P2]

        if SOFT_CAP:  # tanh(x) = 1 - 2 / (exp(2x) + 1), in the exp2 units of the softmax below
            capped = tl.dot(q, k, input_precision=DOT_PRECISION) * (scale / soft_cap)
            scores = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * capped) + 1.0)) * 1.4426950408889634
        else:
            scores = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        visible = (pos[None, :] <= key_limit[:, None]) & key_valid[None, :] & row_valid[:, None]
        if SLIDING:
            visible = visible & (pos[None, :] > key_limit[:, None] - sliding_window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_new = tl.where(m_new > float("-inf"), m_new, 0.0)  # a row with nothing visible yet: no NaN from -inf - -inf
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # A row sees at least key 0 unless its request's metadata is padding (seq_len 0): that row stays zero.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * head_size + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])
