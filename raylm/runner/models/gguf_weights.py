"""A GGUF file's tensors under the Hugging Face names raylm's models load (`model.layers.0.self_attn.q_proj.weight`).

Names map through the `gguf` package's own table (gguf.get_tensor_name_map), so `blk.0.attn_q.weight` becomes the
HF name its converter read it from. Gemma's norms are stored as llama.cpp runs them, with the one the model adds
already folded in: the one comes off here. For the llama architecture llama.cpp's converter reorders the rows of q and
k (each head's two rotary halves interleaved, for its GPT-J style rope); they are put back in HF order here, on packed
blocks as on floats, since a row's blocks never mix rows.

The MoE families' experts come stacked per layer (`blk.N.ffn_{gate,up,down}_exps` [experts, out, in], or gate and up
fused as `ffn_gate_up_exps`) and leave as the fused tensors the models load (`mlp.experts.gate_up_proj` [experts,
2 * inter, hidden] and `down_proj`; GPT-OSS's with gate and up interleaved, transposed, and their biases), always as
floats. DeepSeek's kv_b, which newer llama.cpp files split into `attn_k_b` (transposed) and `attn_v_b`, is put back.

A tensor bound for a layer that keeps blocks (`packed`: its checkpoint names) comes as a QuantizedTensor; every other
one as a float tensor, dequantized when the file stores it quantized. A tensor with no place in the model, or of a
type nothing here can read, is refused by name.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, get_tensor_name_map
from gguf.quants import dequantize as gguf_dequantize

from raylm.configs.gguf_metadata import gguf_architecture, gguf_reader, read_gguf_metadata
from raylm.runner.layers.quantization.ggml_blocks import FORMATS, QuantizedTensor, dequantize

if TYPE_CHECKING:
    from gguf.gguf_reader import ReaderTensor
    from transformers import PretrainedConfig

# HF module names of the Llama-family models raylm runs, per layer and for the whole model.
_LAYER_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
                  "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
                  "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
# Each family's own modules. Phi-3 keeps q/k/v and gate/up fused, in the file as in its HF checkpoint (ffn_up is
# gate_up_proj, not up_proj); the MoE families add their routers, DeepSeek its MLA projections and shared experts.
_DEEPSEEK_MODULES = ("mlp.gate", "mlp.gate.e_score_correction", "self_attn.q_a_proj", "self_attn.q_a_layernorm",
                     "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_a_layernorm",
                     "self_attn.kv_b_proj", "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj",
                     "mlp.shared_experts.down_proj")
_FAMILY_LAYER_MODULES = {"phi3": ("self_attn.qkv_proj", "mlp.gate_up_proj"), "llama": ("mlp.gate",),
                         "qwen3moe": ("mlp.gate",), "deepseek2": _DEEPSEEK_MODULES,
                         "gpt-oss": ("mlp.router", "self_attn.sinks")}
# HF names the gguf package's table spells otherwise (its `.bias` / `.weight` suffix on parameters that have none).
_RENAMED = {"mlp.gate.e_score_correction.bias": "mlp.gate.e_score_correction_bias",
            "self_attn.sinks.weight": "self_attn.sinks"}
_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.(weight|bias)$")
_SPLIT_KV_B = re.compile(r"blk\.(\d+)\.attn_([kv])_b\.weight$")
_NORM_PLUS_ONE = ("gemma2", "gemma3")  # llama.cpp stores Gemma's (1 + weight) norms as 1 + weight
_MODEL_MODULES = ("model.embed_tokens", "model.norm", "lm_head")
# Tensors whose content the config already carries (read by configs.gguf_metadata).
_CONFIG_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
_FLOAT_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}


def hf_tensor_names(arch: str, num_layers: int) -> dict[str, str]:
    """{GGUF tensor name: HF parameter name} for `arch` (a general.architecture value)."""
    model_arch = next(key for key, name in MODEL_ARCH_NAMES.items() if name == arch)
    tensor_map = get_tensor_name_map(model_arch, num_layers)
    layer_modules = (*_LAYER_MODULES, *_FAMILY_LAYER_MODULES.get(arch, ()))  # later names win a shared GGUF name
    modules = [*_MODEL_MODULES, *(f"model.layers.{i}.{m}" for i in range(num_layers) for m in layer_modules)]
    names = {}
    for module in modules:
        gguf_name = tensor_map.get_name(module)
        if gguf_name is not None:
            names.update({f"{gguf_name}.{kind}": _renamed(f"{module}.{kind}") for kind in ("weight", "bias")})
    return names


def _renamed(name: str) -> str:
    for stored, ours in _RENAMED.items():
        if name.endswith(stored):
            return name.removesuffix(stored) + ours
    return name


def iterate_gguf_weights(path: str | Path, hf_config: PretrainedConfig, packed: Collection[str] = (),
                         skip: Callable[[str], bool] = lambda name: False
                         ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """(HF name, tensor) for every tensor of the file that `skip` keeps: a QuantizedTensor for names in `packed`
    stored in a block format, else a float32 (or the file's float dtype) CPU tensor."""
    metadata, _ = read_gguf_metadata(str(path))
    arch = gguf_architecture(metadata)
    names = hf_tensor_names(arch, hf_config.num_hidden_layers)
    heads = {"q_proj": hf_config.num_attention_heads, "k_proj": hf_config.num_key_value_heads}
    pending: dict[tuple[str, int], dict[str, torch.Tensor]] = {}  # a layer's expert or k_b / v_b tensors so far
    for tensor in gguf_reader(str(path)).tensors:
        if tensor.name in _CONFIG_TENSORS:
            continue
        grouped = _EXPERTS.match(tensor.name) or _SPLIT_KV_B.match(tensor.name)
        if grouped is not None:
            layer = int(grouped[1])
            if not skip(f"model.layers.{layer}.mlp.experts.") and not skip(f"model.layers.{layer}.self_attn."):
                yield from _grouped(arch, layer, grouped, _read(tensor, False), pending)
            continue
        name = names.get(tensor.name)
        if name is None:
            raise ValueError(f"GGUF tensor {tensor.name!r} has no counterpart in raylm's {arch} model")
        if skip(name):
            continue
        # MLA multiplies by kv_b's weight itself (absorbed into q and the output), never through the layer's kernel.
        value = _read(tensor, name in packed and not name.endswith("kv_b_proj.weight"))
        module = name.split(".")[-2]
        if arch == "llama" and module in heads:
            value = _unpermute_rows(value, heads[module])
        elif arch in _NORM_PLUS_ONE and name.endswith("norm.weight") and isinstance(value, torch.Tensor):
            value = value - 1
        yield name, value
    if pending:
        (kind, layer), parts = next(iter(pending.items()))
        raise ValueError(f"GGUF file {path}: layer {layer}'s {kind} tensors are incomplete (found {sorted(parts)})")


def _grouped(arch: str, layer: int, match: re.Match[str], value: torch.Tensor | QuantizedTensor,
             pending: dict[tuple[str, int], dict[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Collect one of a layer's stacked expert tensors (or DeepSeek's k_b / v_b) and, once the layer's set is whole,
    yield them as the model's fused tensors."""
    assert isinstance(value, torch.Tensor)  # read as floats
    if match.re is _SPLIT_KV_B:
        parts = pending.setdefault(("attn_k_b/attn_v_b", layer), {})
        parts[match[2]] = value
        if len(parts) == 2:
            del pending[("attn_k_b/attn_v_b", layer)]
            # k_b [heads, kv_lora_rank, nope] (transposed by the converter), v_b [heads, v_head_dim, kv_lora_rank]
            kv_b = torch.cat([parts["k"].transpose(1, 2), parts["v"]], dim=1)
            yield f"model.layers.{layer}.self_attn.kv_b_proj.weight", kv_b.reshape(-1, kv_b.shape[-1])
        return
    parts = pending.setdefault(("expert", layer), {})
    proj, kind = match[2], match[3]
    if proj == "gate_up":  # gate rows first, then up
        parts[f"gate.{kind}"], parts[f"up.{kind}"] = value.chunk(2, dim=1)
    else:
        parts[f"{proj}.{kind}"] = value
    needed = {"gate.weight", "up.weight", "down.weight"}
    if arch == "gpt-oss":
        needed |= {"gate.bias", "up.bias", "down.bias"}
    if not needed <= parts.keys():
        return
    del pending[("expert", layer)]
    prefix = f"model.layers.{layer}.mlp.experts."
    gate, up, down = parts["gate.weight"], parts["up.weight"], parts["down.weight"]
    if arch != "gpt-oss":  # [experts, 2 * inter, hidden] and [experts, hidden, inter]
        yield prefix + "gate_up_proj", torch.cat([gate, up], dim=1)
        yield prefix + "down_proj", down
        return
    # GPT-OSS's checkpoint layout: [experts, hidden, 2 * inter] with gate and up interleaved, down [experts, inter,
    # hidden], each with its bias.
    experts, inter, hidden = gate.shape
    yield prefix + "gate_up_proj", torch.stack([gate, up], dim=-1).transpose(1, 2).reshape(experts, hidden, 2 * inter)
    yield prefix + "gate_up_proj_bias", torch.stack([parts["gate.bias"], parts["up.bias"]], dim=-1).reshape(
        experts, 2 * inter)
    yield prefix + "down_proj", down.transpose(1, 2)
    yield prefix + "down_proj_bias", parts["down.bias"]


def _read(tensor: ReaderTensor, keep_blocks: bool) -> torch.Tensor | QuantizedTensor:
    qtype = GGMLQuantizationType(tensor.tensor_type)
    data = np.array(tensor.data)  # a copy out of the memory map
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists dims innermost first
    if qtype in _FLOAT_TYPES:
        values = torch.from_numpy(data)
        if qtype == GGMLQuantizationType.BF16:
            values = values.view(torch.int16).view(torch.bfloat16)
        return values.reshape(shape)
    fmt = FORMATS.get(qtype.name)
    blocks = torch.from_numpy(data).reshape(shape[0] if len(shape) > 1 else 1, -1)
    if keep_blocks:
        return QuantizedTensor(tensor.name, blocks if fmt is not None else None, fmt, qtype.name)
    if fmt is not None:
        return dequantize(blocks, fmt).reshape(shape)
    try:
        return torch.from_numpy(gguf_dequantize(data, qtype)).reshape(shape)
    except NotImplementedError:
        raise ValueError(f"GGUF tensor {tensor.name!r} is of type {qtype.name}, which the gguf package cannot "
                         "dequantize") from None


def _unpermute_rows(value: torch.Tensor | QuantizedTensor, num_heads: int) -> torch.Tensor | QuantizedTensor:
    """Undo llama.cpp's q/k row order: within a head, row 2i (first rotary half) and 2i + 1 (second half) go back
    to rows i and i + head_dim / 2."""
    if isinstance(value, QuantizedTensor):
        if value.blocks is None:
            return value
        return QuantizedTensor(value.name, _unpermute_tensor_rows(value.blocks, num_heads), value.format,
                               value.type_name)
    return _unpermute_tensor_rows(value, num_heads)


def _unpermute_tensor_rows(value: torch.Tensor, num_heads: int) -> torch.Tensor:
    rows = value.shape[0]
    return (value.reshape(num_heads, rows // num_heads // 2, 2, *value.shape[1:]).transpose(1, 2)
            .reshape(value.shape).contiguous())
