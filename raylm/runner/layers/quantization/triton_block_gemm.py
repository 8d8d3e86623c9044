"""y = x W^T (+ bias) on CUDA with W in blocks (ggml's Q4_0, Q4_1, Q8_0 and raylm's F8_E4M3; `ggml_blocks.py`), one
Triton kernel that reads the blocks as they lie in memory: no float copy of the weight.

A program owns a BLOCK_M x BLOCK_N tile of y and walks K in BLOCK_K steps (whole blocks of 32). Each step loads W's
bytes and fp16 scales for its BLOCK_N output features, decodes them to x's dtype in registers and adds one tl.dot
(float32 accumulation). A 4-bit block's byte j holds weight j (low nibble) and j + 16 (high nibble), so the step
splits into two products of BLOCK_K / 2: the low nibbles against x's first 16 columns of each block, the high ones
against the last 16, and each byte is read once. The scales are read through a view of the same bytes in their type
(float16; float32 for F8_E4M3): every format's blocks are a whole number of scales long, so a block's d (and Q4_1's
m) lie on its type's boundaries. F8_E4M3's bytes are decoded by integer ops (`_e4m3`), not Triton's fp8 type, which
older GPUs cannot convert.

Whether `@triton.jit` builds a GPU kernel or an interpreted one (`TRITON_INTERPRET=1`, CPU tensors: the tests) is
fixed when this module is imported.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from raylm.runner.layers.quantization.ggml_blocks import BLOCK_SIZE, F8_E4M3, Q4_0, Q4_1, Q8_0, BlockFormat

DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # x's dtypes (tl.dot's float inputs)
# Per format: the scales' dtype and how many of them come before a block's values.
HEADERS = {Q4_0.ggml_type: (torch.float16, 1), Q4_1.ggml_type: (torch.float16, 2), Q8_0.ggml_type: (torch.float16, 1),
           F8_E4M3.ggml_type: (torch.float32, 1)}


@triton.jit
def _dot(acc, x, w, DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """acc + x w, w already in x's dtype. Interpreted (CPU tensors), 16-bit operands are multiplied as float32:
    Triton's interpreter multiplies bfloat16 blocks as raw integers, and a product of two 16-bit floats is exact in
    float32, as the GPU's tensor cores take it."""
    if INTERPRETED:
        return tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(x, w, acc, input_precision=DOT_PRECISION)


@triton.jit
def _cast(v, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """float32 v -> dtype, to nearest even as the GPU converts. Triton's interpreter truncates float32 to bfloat16:
    there the bits are rounded first (finite values, which weights and activations are)."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        v = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit
def _e4m3(q):
    """int8 E4M3 bits -> float32, exactly: a normal value's exponent and mantissa shifted into float32's (bias 7 ->
    127), a subnormal one m * 2^-9; the sign applied last. NaN (0x7F, 0xFF) decodes as 480."""
    magnitude = q.to(tl.int32) & 0x7F
    normal = ((magnitude << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    value = tl.where(magnitude < 8, magnitude.to(tl.float32) * 0.001953125, normal)
    return tl.where(q < 0, -value, value)


@triton.jit(do_not_specialize=["M"])  # one build for every batch size of a tile (not one for M = 1, M % 16 == 0)
def block_gemm(x_ptr, w_ptr, w_scale_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_ym, row_bytes,
               FORMAT: tl.constexpr, TYPE_BYTES: tl.constexpr, HEADER_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr,
               HAS_BIAS: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
               INTERPRETED: tl.constexpr):
    """y[rows, cols] for program (pid_n, pid_m). w_ptr: the blocks as int8 (Q8_0's values signed; a nibble is the
    same bits either way), w_scale_ptr: the same bytes as the scales' dtype (SCALE_BYTES each). FORMAT is the
    format's type number (2 Q4_0, 3 Q4_1, 8 Q8_0, 1024 F8_E4M3)."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_rows = cols.to(tl.int64)[None, :] * row_bytes  # [1, BLOCK_N] byte offset of each output feature's blocks
    num_blocks = K // 32
    # tl.full, not tl.zeros (jitted Python, which the interpreter runs only if triton itself was imported under
    # TRITON_INTERPRET=1; torch imports triton first): the kernel runs interpreted in any test process.
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    if FORMAT == 8 or FORMAT == 1024:  # Q8_0, F8_E4M3: position t of the step is weight t % 32 of block t // 32
        t = tl.arange(0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            block = k0 // 32 + t // 32
            k_ok = block < num_blocks
            x = tl.load(x_rows + (k0 + t)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            block_byte = w_rows + (block * TYPE_BYTES)[:, None]  # [BLOCK_K, BLOCK_N]
            w_mask = k_ok[:, None] & col_ok[None, :]
            d = tl.load(w_scale_ptr + block_byte // SCALE_BYTES, mask=w_mask, other=0.0).to(tl.float32)
            q = tl.load(w_ptr + block_byte + HEADER_BYTES + (t % 32)[:, None], mask=w_mask, other=0)
            w = _cast(d * (_e4m3(q) if FORMAT == 1024 else q.to(tl.float32)), x.dtype, INTERPRETED)
            acc = _dot(acc, x, w, DOT_PRECISION, INTERPRETED)
    else:  # 4-bit: position t of each half-step is byte t % 16 of block t // 16
        t = tl.arange(0, BLOCK_K // 2)
        for k0 in range(0, K, BLOCK_K):
            block = k0 // 32 + t // 16
            k_ok = block < num_blocks
            x_mask = row_ok[:, None] & k_ok[None, :]
            k_low = (block * 32 + t % 16)[None, :]
            x_low = tl.load(x_rows + k_low, mask=x_mask, other=0.0)
            x_high = tl.load(x_rows + k_low + 16, mask=x_mask, other=0.0)
            block_byte = w_rows + (block * TYPE_BYTES)[:, None]  # [BLOCK_K / 2, BLOCK_N]
            w_mask = k_ok[:, None] & col_ok[None, :]
            d = tl.load(w_scale_ptr + block_byte // SCALE_BYTES, mask=w_mask, other=0.0).to(tl.float32)
            q = tl.load(w_ptr + block_byte + HEADER_BYTES + (t % 16)[:, None], mask=w_mask, other=0)
            q_low, q_high = (q & 15).to(tl.float32), ((q >> 4) & 15).to(tl.float32)
            if FORMAT == 3:  # Q4_1: w = d * q + m
                m = tl.load(w_scale_ptr + block_byte // SCALE_BYTES + 1, mask=w_mask, other=0.0).to(tl.float32)
                w_low, w_high = d * q_low + m, d * q_high + m
            else:  # Q4_0: w = d * (q - 8)
                w_low, w_high = d * (q_low - 8.0), d * (q_high - 8.0)
            acc = _dot(acc, x_low, _cast(w_low, x_low.dtype, INTERPRETED), DOT_PRECISION, INTERPRETED)
            acc = _dot(acc, x_high, _cast(w_high, x_high.dtype, INTERPRETED), DOT_PRECISION, INTERPRETED)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :],
             _cast(acc, y_ptr.dtype.element_ty, INTERPRETED),
             mask=row_ok[:, None] & col_ok[None, :])


def tiles(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for m rows of x: tl.dot's smallest M (16) and narrow N tiles for decode batches,
    which are memory bound and need many programs to read W at full bandwidth; square 64 tiles for prefill."""
    if m <= 16:
        return 16, 32, 128
    return (32, 64, 64) if m <= 32 else (64, 64, 64)


def block_linear(x: torch.Tensor, packed: torch.Tensor, fmt: BlockFormat, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x W^T (+ bias) in x's dtype (one of DTYPES) with W [N, K] in `fmt`'s blocks (uint8 [N, fmt.row_bytes(K)]);
    x [..., K] on W's device."""
    n, k = packed.shape[0], x.shape[-1]
    assert fmt.ggml_type in HEADERS, f"no Triton kernel for {fmt.name}"
    assert x.dtype in DTYPES, f"the Triton block kernel takes x in {DTYPES}, not {x.dtype}"
    assert k % BLOCK_SIZE == 0 and packed.shape[1] == fmt.row_bytes(k), (
        f"x has {k} features, W {packed.shape[1]} bytes of {fmt.name} blocks per row")
    x2d = x.reshape(-1, k)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    m = x2d.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    w = packed if packed.is_contiguous() else packed.contiguous()
    block_m, block_n, block_k = tiles(m)
    scale_dtype, scales = HEADERS[fmt.ggml_type]
    scale_bytes = scale_dtype.itemsize
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    block_gemm[grid](
        x2d, w.view(torch.int8), w.view(scale_dtype), w if bias is None else bias, y, m, n, k,
        x2d.stride(0), y.stride(0), w.shape[1],
        FORMAT=fmt.ggml_type, TYPE_BYTES=fmt.type_bytes, HEADER_BYTES=scale_bytes * scales, SCALE_BYTES=scale_bytes,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        # float32 stays float32 (no TF32); None: the default of 16-bit inputs
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else None, INTERPRETED=not x.is_cuda)
    return y.reshape(*x.shape[:-1], n)
