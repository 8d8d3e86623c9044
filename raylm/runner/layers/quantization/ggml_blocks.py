"""ggml's block formats, the ones raylm keeps packed: weights quantized along the input dimension in blocks of 32,
each block a scale (and for Q4_1 an offset) in float16 followed by the block's integers. A weight [N, K] is a uint8
tensor [N, K / 32 * type_bytes], one row of blocks per output feature, byte for byte as a GGUF file stores it, so
sharding rows (column parallel) or whole blocks of a row (row parallel) shards the packed tensor directly.

`quantize` rounds as ggml's reference code (and the `gguf` package) does, bit for bit, so `int8` and `int4` on a float
checkpoint give Q8_0 and Q4_1 weights; `dequantize` is plain torch on any device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

BLOCK_SIZE = 32


@dataclass(frozen=True)
class BlockFormat:
    name: str
    ggml_type: int  # GGMLQuantizationType value, also the kernels' switch
    type_bytes: int  # bytes per block of 32 weights
    bits: int

    def row_bytes(self, in_features: int) -> int:
        return in_features // BLOCK_SIZE * self.type_bytes


Q4_0 = BlockFormat("Q4_0", GGMLQuantizationType.Q4_0.value, 18, 4)  # w = d * (q - 8)
Q4_1 = BlockFormat("Q4_1", GGMLQuantizationType.Q4_1.value, 20, 4)  # w = d * q + m
Q8_0 = BlockFormat("Q8_0", GGMLQuantizationType.Q8_0.value, 34, 8)  # w = d * q
FORMATS: dict[str, BlockFormat] = {fmt.name: fmt for fmt in (Q4_0, Q4_1, Q8_0)}


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


def quantize(weight: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """float [N, K] (K a multiple of 32) -> uint8 blocks [N, fmt.row_bytes(K)]."""
    rows, in_features = weight.shape
    if in_features % BLOCK_SIZE:
        raise ValueError(f"{fmt.name}: in_features {in_features} is not a multiple of the {BLOCK_SIZE}-weight block")
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
    else:
        raise ValueError(f"no dequantizer for {fmt.name}")
    return weights.reshape(rows, -1)
