"""The block formats raylm keeps packed: weights quantized along the input dimension in blocks of 32, each block a
scale (and for Q4_1 an offset) followed by the block's 32 values. A weight [N, K] is a uint8 tensor
[N, K / 32 * type_bytes], one row of blocks per output feature, so sharding rows (column parallel) or whole blocks of
a row (row parallel) shards the packed tensor directly.

- ggml's Q4_0, Q4_1, Q8_0 (FORMATS): a float16 scale (and offset) and integers, byte for byte as a GGUF file stores
  them. `quantize` rounds as ggml's reference code (and the `gguf` package) does, bit for bit, so `int8` and `int4`
  on a float checkpoint give Q8_0 and Q4_1 weights.
- raylm's own F8_E4M3, for FP8 checkpoints (compressed-tensors `float-quantized`): a float32 scale (little endian; the
  checkpoint's channel or tensor scale, repeated per block) and 32 E4M3 bytes (torch.float8_e4m3fn's bits), w =
  scale * e4m3. Its values are not integers, so the int8-dot kernel does not take it (`integer`). `quantize` rounds
  each row to E4M3 under a row scale of max |w| / 448.

`dequantize` is plain torch on any device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

BLOCK_SIZE = 32


@dataclass(frozen=True)
class BlockFormat:
    name: str
    ggml_type: int  # the kernels' switch: the GGMLQuantizationType value, or a raylm-own number (F8_E4M3)
    type_bytes: int  # bytes per block of 32 weights
    bits: int
    integer: bool = True  # its values are integers (the int8-dot kernel, `packed_int8`, takes only those)

    def row_bytes(self, in_features: int) -> int:
        return in_features // BLOCK_SIZE * self.type_bytes


Q4_0 = BlockFormat("Q4_0", GGMLQuantizationType.Q4_0.value, 18, 4)  # w = d * (q - 8)
Q4_1 = BlockFormat("Q4_1", GGMLQuantizationType.Q4_1.value, 20, 4)  # w = d * q + m
Q8_0 = BlockFormat("Q8_0", GGMLQuantizationType.Q8_0.value, 34, 8)  # w = d * q
FORMATS: dict[str, BlockFormat] = {fmt.name: fmt for fmt in (Q4_0, Q4_1, Q8_0)}  # ggml's, by their GGUF names
# ggml's type numbers count up from 0 (under 64 so far); 1024 leaves them room and says it is raylm's. The C++
# kernels switch on the same number (csrc/quant/block_formats.h, kF8E4M3).
F8_E4M3 = BlockFormat("F8_E4M3", 1024, 36, 8, integer=False)  # w = scale (float32) * e4m3
_FP8_MAX = 448.0  # the largest finite E4M3 value


@dataclass(frozen=True)
class QuantizedTensor:
    """A checkpoint weight [rows, in_features] still in its file's format: packed blocks when `format` is one raylm
    runs (`blocks` then uint8 [rows, row_bytes]), else just the format's name for the error message."""

    name: str  # the tensor's name in the file, for messages
    blocks: torch.Tensor | None
    format: BlockFormat | None
    type_name: str


def _half_bytes(values: torch.Tensor) -> torch.Tensor:
    """[..., 1] float32 -> [..., 2] uint8, float16 little-endian (numpy's astype(float16) rounding)."""
    return values.to(torch.float16).view(torch.uint8)


def _round_half_away(values: torch.Tensor) -> torch.Tensor:
    """ggml's roundf as the `gguf` package writes it (floor of |x| plus the rounded-up half)."""
    magnitude = values.abs()
    floored = magnitude.floor()
    return values.sign() * (floored + (2 * (magnitude - floored)).floor())


def _inverse(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale == 0, torch.zeros_like(scale), 1 / scale)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[..., 32] values 0..15 -> [..., 16] bytes: weight j in the low nibble, weight j + 16 in the high one."""
    return q[..., :16] | (q[..., 16:] << 4)


def pack_fp8(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 values [N, K] (K a multiple of 32) and float32 scales (one per row [N] / [N, 1], or one [1] / []) -> uint8
    F8_E4M3 blocks [N, K / 32 * 36], each block's scale the float32 bits of its row's."""
    rows, in_features = values.shape
    if in_features % BLOCK_SIZE:
        raise ValueError(f"F8_E4M3: in_features {in_features} is not a multiple of the {BLOCK_SIZE}-weight block")
    q = values.to(torch.float8_e4m3fn).view(torch.uint8).reshape(rows, -1, BLOCK_SIZE)
    per_block = scale.to(torch.float32).reshape(-1, 1, 1).expand(rows, q.shape[1], 1).contiguous()
    return torch.cat([per_block.view(torch.uint8), q], dim=-1).reshape(rows, -1).contiguous()


def quantize(weight: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """float [N, K] (K a multiple of 32) -> uint8 blocks [N, fmt.row_bytes(K)]."""
    rows, in_features = weight.shape
    if in_features % BLOCK_SIZE:
        raise ValueError(f"{fmt.name}: in_features {in_features} is not a multiple of the {BLOCK_SIZE}-weight block")
    if fmt is F8_E4M3:
        weight = weight.detach().to(torch.float32)
        scale = weight.abs().amax(dim=1) / _FP8_MAX
        return pack_fp8((weight * _inverse(scale).unsqueeze(1)).clamp(-_FP8_MAX, _FP8_MAX), scale)
    blocks = weight.detach().to(torch.float32).reshape(rows, -1, BLOCK_SIZE)
    if fmt is Q8_0:
        scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
        q = _round_half_away(blocks * _inverse(scale)).to(torch.int8).view(torch.uint8)
        packed = torch.cat([_half_bytes(scale), q], dim=-1)
    elif fmt is Q4_1:
        low, high = blocks.amin(dim=-1, keepdim=True), blocks.amax(dim=-1, keepdim=True)
        scale = (high - low) / 15
        q = ((blocks - low) * _inverse(scale) + 0.5).trunc().clamp(0, 15).to(torch.uint8)
        packed = torch.cat([_half_bytes(scale), _half_bytes(low), _pack_nibbles(q)], dim=-1)
    elif fmt is Q4_0:
        extreme = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))
        scale = extreme / -8
        q = (blocks * _inverse(scale) + 8.5).trunc().clamp(0, 15).to(torch.uint8)
        packed = torch.cat([_half_bytes(scale), _pack_nibbles(q)], dim=-1)
    else:
        raise ValueError(f"no quantizer for {fmt.name}")
    return packed.reshape(rows, -1).contiguous()


def _halves(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    return blocks[..., offset:offset + 2].contiguous().view(torch.float16).to(torch.float32)


def _unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    return torch.cat([qs & 15, qs >> 4], dim=-1).to(torch.float32)


def dequantize(packed: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """uint8 blocks [N, row_bytes] -> float32 [N, K], on the blocks' device."""
    rows = packed.shape[0]
    blocks = packed.reshape(rows, -1, fmt.type_bytes)
    if fmt is Q8_0:
        weights = _halves(blocks, 0) * blocks[..., 2:].contiguous().view(torch.int8).to(torch.float32)
    elif fmt is Q4_1:
        weights = _halves(blocks, 0) * _unpack_nibbles(blocks[..., 4:]) + _halves(blocks, 2)
    elif fmt is Q4_0:
        weights = _halves(blocks, 0) * (_unpack_nibbles(blocks[..., 2:]) - 8)
    elif fmt is F8_E4M3:
        scale = blocks[..., :4].contiguous().view(torch.float32)
        weights = scale * blocks[..., 4:].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    else:
        raise ValueError(f"no dequantizer for {fmt.name}")
    return weights.reshape(rows, -1)
