"""Checkpoints quantized as they are shipped: the `quantization_config` of config.json read once, on the driver, into
one CheckpointQuant, or refused by name before anything loads.

- `compressed-tensors` (llmcompressor's output): `pack-quantized` int4 / int8 weights (group or channel scales,
  symmetric or with a zero point, GPTQ's activation order as `actorder: group`), `int-quantized` W8A8 (int8 channel
  weights, dynamic per-token int8 activations), `float-quantized` FP8 (per tensor or channel, dynamic per-token FP8
  activations).
- `gptq` (GPTQModel / AutoGPTQ): 4- or 8-bit, groups or channels, `desc_act` on or off, sym or asym, in the `gptq`
  (zero points stored minus one) or `gptq_v2` checkpoint format.
- `awq` (AutoAWQ / GPTQModel): 4-bit, groups, zero points, the GEMM layout.

How each runs: raylm/runner/layers/quantization/checkpoint_formats.py and docs/quantization-formats.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raylm.configs.model_info import ModelInfo

CHECKPOINT_FORMATS = ("compressed-tensors", "gptq", "awq")
BLOCK = 32  # the block of raylm's kernels: a group must hold whole blocks to repack exactly
_CT_FORMATS = {"pack-quantized": "pack-quantized", "int-quantized": "int-quantized",
               "naive-quantized": "int-quantized", "float-quantized": "float-quantized"}


@dataclass(frozen=True)
class CheckpointQuant:
    """One checkpoint's scheme, the same for every quantized linear (a layer stored float stays float)."""

    method: str  # one of CHECKPOINT_FORMATS: the `quantization` value
    layout: str  # pack-quantized | int-quantized | float-quantized | gptq | gptq_v2 | awq-gemm
    bits: int
    weight_type: str  # int | float
    strategy: str  # group | channel | tensor
    group_size: int | None  # for strategy group
    symmetric: bool
    act_order: bool  # input channels in activation order (GPTQ desc_act, compressed-tensors actorder: group)
    activations: str | None  # None (weight-only), "int8" or "fp8": quantized per token at run time

    def describe(self) -> str:
        scales = f"group {self.group_size}" if self.strategy == "group" else f"per {self.strategy}"
        parts = [f"{self.method} {self.layout}", f"{self.weight_type}{self.bits} weights", scales,
                 "symmetric" if self.symmetric else "zero points"]
        if self.act_order:
            parts.append("activation order")
        if self.activations:
            parts.append(f"dynamic per-token {self.activations} activations")
        return ", ".join(parts)


def quantization_config(hf_config: Any) -> dict[str, Any] | None:
    """config.json's `quantization_config` (transformers may keep it as a dict or as its own config object)."""
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return None
    return config if isinstance(config, dict) else config.to_dict()


def read_checkpoint_quant(hf_config: Any) -> CheckpointQuant | None:
    """The checkpoint's scheme, None for a checkpoint with no quantization_config; ValueError for one raylm does not
    run, naming the field, its value and what would work."""
    config = quantization_config(hf_config)
    if config is None:
        return None
    method = str(config.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    if method == "gptq":
        return _gptq(config)
    if method == "awq":
        return _awq(config)
    raise ValueError(f"quantization_config.quant_method {method!r}: raylm loads checkpoints quantized by "
                     f"{', '.join(CHECKPOINT_FORMATS)} (or quantizes a float checkpoint with quantization 'int8' / "
                     "'int4')")


def resolve_checkpoint_quantization(setting: str | None, model_info: ModelInfo) -> str | None:
    """The `quantization` value for a quantized checkpoint (its format), None for a float one. A setting that differs
    from the checkpoint's format is refused: its weights are already quantized."""
    quant = read_checkpoint_quant(model_info.hf_config)
    if quant is None:
        if setting in CHECKPOINT_FORMATS:
            raise ValueError(f"quantization {setting!r}: {model_info.path} has no quantization_config in its "
                             "config.json (a float checkpoint: use 'int8' or 'int4' to quantize it, or 'none')")
        return None
    if setting not in (None, quant.method):
        raise ValueError(f"quantization {setting!r}: {model_info.path} is already quantized ({quant.describe()}); "
                         f"leave quantization unset or set {quant.method!r}")
    return quant.method


def tensor_parallel_problem(model_info: ModelInfo, quantization: str, tp: int) -> str | None:
    """Why a checkpoint format cannot split over `tp` ranks beyond the 32-weight blocks every quantized layer needs
    (its groups are repacked into blocks that each carry their scale, so a group may straddle two ranks)."""
    if quantization not in CHECKPOINT_FORMATS or tp == 1:
        return None
    quant = read_checkpoint_quant(model_info.hf_config)
    if quant is not None and quant.act_order:
        return (f"quantization {quantization!r} in activation order (GPTQ desc_act) permutes each linear's input "
                "channels, and a row-parallel rank's slice of them is not whole groups of the permuted order "
                "(use tensor_parallel_size 1, or a checkpoint quantized with desc_act false)")
    return None


def _group_size(field: str, value: Any) -> int | None:
    """A group size raylm repacks exactly (a multiple of 32), or None for -1 / None (one scale per channel)."""
    if value in (None, -1):
        return None
    if int(value) <= 0 or int(value) % BLOCK:
        raise ValueError(f"quantization_config.{field} {value}: raylm repacks groups into its {BLOCK}-weight "
                         f"blocks, so a group size must be a multiple of {BLOCK} (or -1: one scale per channel)")
    return int(value)


def _compressed_tensors(config: dict[str, Any]) -> CheckpointQuant:
    for field in ("kv_cache_scheme", "transform_config"):
        if config.get(field):
            raise ValueError(f"quantization_config.{field}: raylm runs no {field.removesuffix('_config')} of "
                             "compressed-tensors (its KV cache is in the model's dtype); use a checkpoint without it")
    sparsity = config.get("sparsity_config") or {}
    if sparsity.get("format") not in (None, "dense"):
        raise ValueError(f"quantization_config.sparsity_config.format {sparsity['format']!r}: raylm runs no sparse "
                         "compressed-tensors weights")
    groups = config.get("config_groups") or {}
    schemes = {_ct_scheme(name, group, config.get("format")) for name, group in groups.items()}
    if len(schemes) != 1:
        raise ValueError(f"quantization_config.config_groups: {len(schemes)} different schemes "
                         f"({', '.join(groups) or 'none'}); raylm runs one scheme per checkpoint")
    return schemes.pop()


def _ct_scheme(name: str, group: dict[str, Any], default_format: str | None) -> CheckpointQuant:
    where = f"quantization_config.config_groups.{name}"
    fmt = group.get("format") or default_format
    if fmt not in _CT_FORMATS:
        raise ValueError(f"{where}.format {fmt!r}: raylm runs the compressed-tensors formats "
                         f"{', '.join(sorted(_CT_FORMATS))}")
    targets = [str(t) for t in group.get("targets") or []]
    if any(t in ("Embedding", "MoE") or "embed" in t for t in targets):
        raise ValueError(f"{where}.targets {targets}: raylm quantizes linear layers only (not embeddings)")
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    bits, kind, strategy = int(weights.get("num_bits", 0)), str(weights.get("type")), str(weights.get("strategy"))
    symmetric = bool(weights.get("symmetric", True))
    layout = _CT_FORMATS[fmt]
    if group.get("output_activations"):
        raise ValueError(f"{where}.output_activations: raylm quantizes no layer outputs")
    if strategy not in ("group", "channel", "tensor") or (strategy == "tensor" and layout == "pack-quantized"):
        raise ValueError(f"{where}.weights.strategy {strategy!r}: raylm runs group and channel scales (and per "
                         "tensor for int8 / FP8)")
    group_size = _group_size(f"config_groups.{name}.weights.group_size", weights.get("group_size")) \
        if strategy == "group" else None
    actorder = weights.get("actorder")
    if actorder not in (None, "static", "weight", "group"):
        raise ValueError(f"{where}.weights.actorder {actorder!r}: raylm honours 'group' and 'weight'")
    act_order = actorder == "group"  # "weight" reorders only while quantizing: the stored weights are in order
    if layout == "float-quantized":
        if (kind, bits) != ("float", 8) or strategy == "group":
            raise ValueError(f"{where}.weights: {kind}{bits} {strategy}: raylm runs FP8 (float, 8 bits) weights "
                             "per tensor or per channel")
    elif kind != "int" or bits not in (4, 8) or (layout == "int-quantized" and bits != 8):
        raise ValueError(f"{where}.weights: {kind}{bits} in {fmt}: raylm runs int4 and int8 weights")
    elif bits == 8 and not symmetric:
        raise ValueError(f"{where}.weights.symmetric false with 8 bits: raylm's int8 blocks have no zero point")
    return CheckpointQuant("compressed-tensors", layout, bits, kind, strategy, group_size, symmetric, act_order,
                           _ct_activations(where, inputs, layout))


def _ct_activations(where: str, inputs: dict[str, Any] | None, layout: str) -> str | None:
    if not inputs:
        return None
    kind, bits = inputs.get("type"), int(inputs.get("num_bits", 0))
    wanted = {"int-quantized": ("int", 8), "float-quantized": ("float", 8)}.get(layout)
    dynamic_tokens = inputs.get("dynamic") is True and inputs.get("strategy") == "token"
    if (kind, bits) != wanted or not dynamic_tokens or not inputs.get("symmetric", True):
        raise ValueError(f"{where}.input_activations: {kind}{bits} {inputs.get('strategy')} dynamic "
                         f"{inputs.get('dynamic')}: raylm quantizes activations dynamically per token, symmetric, "
                         "int8 beside int8 weights and FP8 beside FP8 weights (static activation scales are not run)")
    return "int8" if kind == "int" else "fp8"


def _gptq(config: dict[str, Any]) -> CheckpointQuant:
    bits, sym = int(config.get("bits", 0)), bool(config.get("sym", True))
    layout = str(config.get("checkpoint_format") or config.get("format") or "gptq").lower()
    if layout not in ("gptq", "gptq_v2"):
        raise ValueError(f"quantization_config.checkpoint_format {layout!r}: raylm reads the 'gptq' and 'gptq_v2' "
                         "layouts (other layouts are a kernel's repacking of them)")
    if bits not in (4, 8) or (bits == 8 and not sym):
        raise ValueError(f"quantization_config.bits {bits} (sym {sym}): raylm runs 4-bit GPTQ and symmetric 8-bit "
                         "GPTQ in its 32-weight blocks; 2- and 3-bit weights have no kernel here")
    if config.get("lm_head"):
        raise ValueError("quantization_config.lm_head true: raylm keeps the LM head of a GPTQ checkpoint float; use "
                         "a checkpoint quantized with lm_head false")
    group_size = _group_size("group_size", config.get("group_size"))
    return CheckpointQuant("gptq", layout, bits, "int", "group" if group_size else "channel", group_size, sym,
                           bool(config.get("desc_act")), None)


def _awq(config: dict[str, Any]) -> CheckpointQuant:
    version = str(config.get("version") or config.get("format") or "gemm").lower()
    bits = int(config.get("bits", config.get("w_bit", 0)))
    if version != "gemm":
        raise ValueError(f"quantization_config.version {version!r}: raylm reads AWQ's GEMM layout only")
    if bits != 4 or not config.get("zero_point", True):
        raise ValueError(f"quantization_config.bits {bits} (zero_point {config.get('zero_point', True)}): raylm runs "
                         "4-bit AWQ with zero points")
    group_size = _group_size("group_size", config.get("group_size", config.get("q_group_size")))
    return CheckpointQuant("awq", "awq-gemm", 4, "int", "group" if group_size else "channel", group_size, False,
                           False, None)
