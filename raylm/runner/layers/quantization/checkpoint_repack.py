"""A quantized checkpoint's tensors of one linear (compressed-tensors, GPTQ, AWQ) -> the blocks raylm's kernels
run, once at load. The mapping to ggml's blocks is exact up to float16 scales (their scale type):

- 4-bit symmetric (w = s * (q - 8), q unsigned): Q4_0 with d = s.
- 4-bit with zero points (w = s * (q - z)): Q4_1 with d = s and m = -s * z (m rounded to float16: at most 2^-11 of
  s * z, under 1% of one quantization step).
- 8-bit symmetric (w = s * q, q signed): Q8_0 with d = s.
A group of g (a multiple of 32) input features becomes g / 32 blocks that each repeat the group's scale (and zero); a
channel or tensor scale repeats over every block of its row. GPTQ's activation order (g_idx not in input order) is
made input order by permuting the input channels once here; the layer then permutes x the same way (`input_perm`).
- FP8 (E4M3 weights, a float32 scale per channel or for the tensor): raylm's F8_E4M3 blocks, the E4M3 bytes as
  stored and the row's scale repeated in each block, exactly (a float16 or bfloat16 scale widens to float32 exactly).
  The weight stays one byte a weight (plus 4 a block), decoded to the same float32 products fp8 x scale as before."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from raylm.configs.quant_formats import CheckpointQuant
from raylm.runner.layers.quantization.ggml_blocks import (
    BLOCK_SIZE,
    F8_E4M3,
    Q4_0,
    Q4_1,
    Q8_0,
    QuantizedTensor,
    pack_fp8,
)

_AWQ_COLUMNS = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])  # AWQ's GEMM layout packs columns 0,2,4,6,1,3,5,7 per word


@dataclass(frozen=True)
class RepackedTensor(QuantizedTensor):
    """A checkpoint linear in raylm blocks, with the input permutation x needs when its input channels were put in
    the order of their groups (GPTQ desc_act), else None."""

    input_perm: torch.Tensor | None = None


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding 32 / bits values each, the first in the low bits, packed along `dim` -> unsigned int32."""
    words = packed.to(torch.int32)
    if dim == 0:
        words = words.t()
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    values = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    values = values.reshape(words.shape[0], -1)
    return values.t() if dim == 0 else values


def to_blocks(name: str, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
              input_perm: torch.Tensor | None = None) -> RepackedTensor:
    """Unsigned q [N, K] (bits 4) or signed q (bits 8), scales and zeros [N, K / 32] (one per block), zeros None for a
    symmetric 4-bit weight (w = s * (q - 8)) and for 8 bits -> blocks."""
    rows, in_features = q.shape
    if in_features % BLOCK_SIZE:
        raise ValueError(f"checkpoint tensor {name}: {in_features} input features are not whole {BLOCK_SIZE}-weight "
                         "blocks")
    d = scales.to(torch.float32).reshape(rows, -1, 1)
    halves = [d.to(torch.float16).view(torch.uint8)]
    if bits == 8:
        fmt = Q8_0
        values = q.to(torch.int8).view(torch.uint8).reshape(rows, -1, BLOCK_SIZE)
    else:
        if zeros is not None and bool((zeros == 8).all()):
            zeros = None  # a symmetric weight stored with zero points (GPTQ sym): Q4_0's own formula
        fmt = Q4_0 if zeros is None else Q4_1
        if zeros is not None:
            halves.append((-d * zeros.to(torch.float32).reshape(rows, -1, 1)).to(torch.float16).view(torch.uint8))
        nibbles = q.to(torch.uint8).reshape(rows, -1, BLOCK_SIZE)
        values = nibbles[..., :16] | (nibbles[..., 16:] << 4)
    blocks = torch.cat([*halves, values], dim=-1).reshape(rows, -1).contiguous()
    return RepackedTensor(name, blocks, fmt, f"{fmt.name} from {name}", input_perm)


def per_block(name: str, values: torch.Tensor, rows: int, in_features: int, group_size: int | None = None
              ) -> torch.Tensor:
    """Per-group [N, G] (G groups of `group_size` along the input, the last one possibly shorter; 1 for a channel,
    [1] or [] for the tensor) -> [N, K / 32]."""
    blocks = in_features // BLOCK_SIZE
    values = values.reshape(1, 1) if values.numel() == 1 else values
    groups = -(-in_features // group_size) if group_size else 1
    if values.dim() != 2 or values.shape[0] not in (1, rows) or values.shape[1] != groups:
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(values.shape)}: a weight of {rows} x "
                         f"{in_features} needs one value per row and group ({groups} groups of "
                         f"{group_size or in_features})")
    block_groups = torch.arange(blocks, device=values.device) * BLOCK_SIZE // (group_size or in_features)
    return values.expand(rows, groups)[:, block_groups]


def group_order(name: str, g_idx: torch.Tensor, group_size: int | None, in_features: int
                ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(input permutation or None, group of each block after it) from GPTQ's g_idx (the group of each input
    channel). In input order the groups are runs of group_size; in activation order (desc_act) sorting the channels
    by group must give such runs, which the permutation then makes."""
    size = group_size or in_features
    runs = torch.arange(in_features, device=g_idx.device) // size
    g_idx = g_idx.to(torch.int64)
    if g_idx.shape != (in_features,):
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(g_idx.shape)}, not ({in_features},)")
    if torch.equal(g_idx, runs):
        return None, runs[::BLOCK_SIZE]
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], runs):
        raise ValueError(f"checkpoint tensor {name}: its groups do not each hold group_size {size} input channels, "
                         "so sorting the channels by group gives no whole groups")
    return perm, runs[::BLOCK_SIZE]


def repack(prefix: str, tensors: dict[str, torch.Tensor], quant: CheckpointQuant) -> RepackedTensor:
    """One linear's checkpoint tensors (by suffix) -> blocks."""
    if quant.method == "gptq":
        return _gptq(prefix, tensors, quant)
    if quant.method == "awq":
        return _awq(prefix, tensors, quant.group_size)
    if quant.layout == "pack-quantized":
        return _ct_packed(prefix, tensors, quant)
    weight, scale = tensors["weight"], tensors["weight_scale"]
    rows, in_features = weight.shape
    if quant.layout == "float-quantized":
        scale = scale.to(torch.float32).reshape(-1, 1) if scale.numel() > 1 else scale.to(torch.float32).reshape(1, 1)
        if scale.shape[0] not in (1, rows):
            raise ValueError(f"checkpoint tensor {prefix}.weight_scale has shape {tuple(tensors['weight_scale'].shape)}"
                             f": a weight of {rows} rows needs one scale per row or one for the tensor")
        if in_features % BLOCK_SIZE:
            raise ValueError(f"checkpoint tensor {prefix}.weight: {in_features} input features are not whole "
                             f"{BLOCK_SIZE}-weight blocks")
        return RepackedTensor(prefix, pack_fp8(weight, scale), F8_E4M3, f"{F8_E4M3.name} from {prefix}")
    zero = tensors.get("weight_zero_point")
    if zero is not None and bool(zero.any()):
        raise ValueError(f"checkpoint tensor {prefix}.weight_zero_point is not zero: raylm's int8 blocks have none")
    return to_blocks(prefix, weight, per_block(f"{prefix}.weight_scale", scale, rows, in_features), None, 8)


def _ct_packed(prefix: str, tensors: dict[str, torch.Tensor], quant: CheckpointQuant) -> RepackedTensor:
    rows, in_features = (int(v) for v in tensors["weight_shape"].tolist())
    offset = 1 << (quant.bits - 1)  # compressed-tensors stores q + 2^(bits-1), q signed
    q = unpack_int32(tensors["weight_packed"], quant.bits, dim=1)
    if q.shape[0] != rows or q.shape[1] < in_features:
        raise ValueError(f"checkpoint tensor {prefix}.weight_packed has shape {tuple(tensors['weight_packed'].shape)}"
                         f", too small for weight_shape {rows} x {in_features} at {quant.bits} bits")
    q = q[:, :in_features]
    perm, block_groups = None, None
    if "weight_g_idx" in tensors:
        perm, block_groups = group_order(f"{prefix}.weight_g_idx", tensors["weight_g_idx"], quant.group_size,
                                         in_features)
        if perm is not None:
            q = q[:, perm]
    groups = -(-in_features // quant.group_size) if quant.group_size else 1
    if quant.strategy != "tensor" and tuple(tensors["weight_scale"].shape) != (rows, groups):
        raise ValueError(f"checkpoint tensor {prefix}.weight_scale has shape {tuple(tensors['weight_scale'].shape)}, "
                         f"but {quant.strategy} scales (group_size {quant.group_size}) over {in_features} input "
                         f"features need ({rows}, {groups})")
    scale = _blocks_of(f"{prefix}.weight_scale", tensors["weight_scale"], rows, in_features, block_groups,
                       quant.group_size)
    zeros = None
    if not quant.symmetric:  # packed along the rows, each zero point stored + 2^(bits-1) as q is
        zero = unpack_int32(tensors["weight_zero_point"], quant.bits, dim=0)[:rows]
        zeros = _blocks_of(f"{prefix}.weight_zero_point", zero, rows, in_features, block_groups, quant.group_size)
    if quant.bits == 8:
        return to_blocks(prefix, q - offset, scale, None, 8, perm)
    return to_blocks(prefix, q, scale, zeros, 4, perm)  # zero points are stored + 8 as well: w = s * (q' - z')


def _blocks_of(name: str, values: torch.Tensor, rows: int, in_features: int, block_groups: torch.Tensor | None,
               group_size: int | None) -> torch.Tensor:
    """Per-group values [rows, G] -> per block, by each block's group when the groups were reordered."""
    if block_groups is None:
        return per_block(name, values, rows, in_features, group_size)
    if values.shape[0] != rows or values.shape[1] <= int(block_groups.max()):
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(values.shape)}: {rows} rows and a column for "
                         f"each of {int(block_groups.max()) + 1} groups are needed")
    return values[:, block_groups]


def _gptq(prefix: str, tensors: dict[str, torch.Tensor], quant: CheckpointQuant) -> RepackedTensor:
    bits = quant.bits
    q = unpack_int32(tensors["qweight"], bits, dim=0).t()  # [K, N] packed along K -> [N, K]
    rows, in_features = q.shape
    scales = tensors["scales"].t()  # [G, N] -> [N, G]
    groups = -(-in_features // quant.group_size) if quant.group_size else 1
    if scales.shape != (rows, groups):
        raise ValueError(f"checkpoint tensor {prefix}.scales has shape {tuple(tensors['scales'].shape)}, but "
                         f"group_size {quant.group_size or -1} over {in_features} input features needs "
                         f"({groups}, {rows})")
    zeros = unpack_int32(tensors["qzeros"], bits, dim=1)[:, :rows].t()
    if zeros.shape != (rows, groups):
        raise ValueError(f"checkpoint tensor {prefix}.qzeros holds {tuple(zeros.shape[::-1])} zero points, not "
                         f"({groups}, {rows})")
    if quant.layout == "gptq":  # GPTQ v1 stores zero - 1 (wrapping within the bits)
        zeros = (zeros + 1) & ((1 << bits) - 1)
    g_idx = tensors.get("g_idx")
    perm, block_groups = (None, None) if g_idx is None else group_order(
        f"{prefix}.g_idx", g_idx, quant.group_size, in_features)
    if perm is not None:
        q = q[:, perm]
    scale = _blocks_of(f"{prefix}.scales", scales, rows, in_features, block_groups, quant.group_size)
    zero = _blocks_of(f"{prefix}.qzeros", zeros, rows, in_features, block_groups, quant.group_size)
    if bits == 8:
        if not bool((zero == 128).all()):
            raise ValueError(f"checkpoint tensor {prefix}.qzeros: 8-bit zero points other than 128 (asymmetric) "
                             "have no raylm kernel")
        return to_blocks(prefix, q - 128, scale, None, 8, perm)
    return to_blocks(prefix, q, scale, zero, 4, perm)


def _awq(prefix: str, tensors: dict[str, torch.Tensor], group_size: int | None) -> RepackedTensor:
    def columns(packed: torch.Tensor) -> torch.Tensor:  # [R, C / 8] words -> [R, C] in column order
        values = unpack_int32(packed, 4, dim=1)
        return values.reshape(values.shape[0], -1, 8)[..., _AWQ_COLUMNS].reshape(values.shape[0], -1)

    q, zeros, scales = columns(tensors["qweight"]).t(), columns(tensors["qzeros"]).t(), tensors["scales"].t()
    rows, in_features = q.shape
    if scales.shape != zeros.shape or scales.shape[0] != rows:
        raise ValueError(f"checkpoint tensor {prefix}.scales has shape {tuple(tensors['scales'].shape)} and "
                         f"{prefix}.qzeros holds {tuple(zeros.t().shape)} zero points; a weight of {in_features} x "
                         f"{rows} needs the same [groups, {rows}] for both")
    return to_blocks(prefix, q, per_block(f"{prefix}.scales", scales, rows, in_features, group_size),
                     per_block(f"{prefix}.qzeros", zeros, rows, in_features, group_size), 4)
