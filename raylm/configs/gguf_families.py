"""The config settings a GGUF file carries for the families whose shape goes beyond Llama's: Gemma 2 and 3 (sliding
window and its layer pattern, soft-capping, attention scale, Gemma 3's local and global rope bases) and Phi-3
(partial rotary, LongRoPE's factors). Keys are those llama.cpp's converter writes and its loader reads; where llama.cpp
hard-codes a value instead of storing it (Gemma's layer patterns, the local rope base, the 27B models' attention
scale), the same value is used here, so a file converted by llama.cpp loads as llama.cpp runs it.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

Getter = Callable[..., Any]  # get(key, default=...) -> the `{arch}.{key}` metadata value
TensorValues = Callable[[str], list[float]]  # a small float tensor of the file (rope factors), by name

# general.architecture -> the transformers model_type its config is built as.
MODEL_TYPES = {"gemma3": "gemma3_text"}
# llama.cpp's layer pattern where a file stores none: every 2nd (Gemma 2) or 6th (Gemma 3) layer is global.
_GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}
# Layer counts of Gemma 2 27B and Gemma 3 27B: llama.cpp scales their attention by hidden / heads (their
# query_pre_attn_scalar), every other size's by head_dim.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA3_LOCAL_ROPE_BASE = 10000.0  # llama.cpp's rope base for Gemma 3's sliding layers where the file has none


def family_settings(arch: str, get: Getter, tensor_values: TensorValues, tensors: frozenset[str],
                    rope: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """The config settings `arch` adds to (or replaces in) the Llama-shaped ones, `rope` being the rope_parameters
    read from the file's rope keys. Refuses a partial rotary embedding where the family has none."""
    rotary_dim = int(get("rope.dimension_count", head_dim))
    if arch == "phi3":
        return _phi3(get, tensor_values, tensors, rope, rotary_dim / head_dim)
    if rotary_dim != head_dim:
        raise ValueError(f"GGUF {arch} file: rotary embedding over {rotary_dim} of {head_dim} head dimensions "
                         "(partial rotary) is not supported for this architecture")
    if arch in _GEMMA_PATTERN:
        return _gemma(arch, get, rope, head_dim)
    return {"rope_parameters": rope}


def _gemma(arch: str, get: Getter, rope: dict[str, Any], head_dim: int) -> dict[str, Any]:
    layers = int(get("block_count"))
    pattern = get("attention.sliding_window_pattern", _GEMMA_PATTERN[arch])
    if isinstance(pattern, list):  # one bool per layer, true: sliding
        if len(pattern) != layers:
            raise ValueError(f"GGUF {arch} file: attention.sliding_window_pattern has {len(pattern)} entries for "
                             f"{layers} layers")
        sliding = [bool(s) for s in pattern]
    else:  # every pattern-th layer is global
        sliding = [(i + 1) % int(pattern) != 0 for i in range(layers)]
    scale = get("attention.scale", None)
    if scale is not None:
        query_pre_attn_scalar = float(scale) ** -2
    elif layers == _GEMMA_27B_LAYERS[arch]:
        query_pre_attn_scalar = int(get("embedding_length")) // _first(get("attention.head_count"))
    else:
        query_pre_attn_scalar = head_dim
    final_cap = get("final_logit_softcapping", None)
    settings: dict[str, Any] = dict(
        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=query_pre_attn_scalar,
        sliding_window=int(get("attention.sliding_window")),
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        final_logit_softcapping=float(final_cap) if final_cap else None, rope_parameters=rope)
    if arch == "gemma2":
        attn_cap = get("attn_logit_softcapping", None)
        settings["attn_logit_softcapping"] = float(attn_cap) if attn_cap else None
    else:  # the file's rope base and scaling are the global layers'; the sliding ones rotate with their own base
        local = {"rope_type": "default", "rope_theta": float(get("rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_BASE))}
        settings["rope_parameters"] = {"sliding_attention": local, "full_attention": rope}
    return settings


def _phi3(get: Getter, tensor_values: TensorValues, tensors: frozenset[str], rope: dict[str, Any],
          partial_rotary_factor: float) -> dict[str, Any]:
    context = int(get("context_length"))
    original = int(get("rope.scaling.original_context_length", context))
    window = int(get("attention.sliding_window", 0))  # llama.cpp's converter writes 0 for none
    rope = {**rope, "partial_rotary_factor": partial_rotary_factor}
    if "rope_factors_long.weight" in tensors:  # LongRoPE: its per-frequency factors are tensors of the file
        rope.update(rope_type="longrope", long_factor=tensor_values("rope_factors_long.weight"),
                    short_factor=tensor_values("rope_factors_short.weight"), original_max_position_embeddings=original)
        attn_factor = get("rope.scaling.attn_factor", None)
        if attn_factor is not None:
            rope["attention_factor"] = float(attn_factor)
    return dict(partial_rotary_factor=partial_rotary_factor, original_max_position_embeddings=original,
                sliding_window=window or None, rope_parameters=rope)


def _first(value: Any) -> int:
    return int(value[0] if isinstance(value, list) else value)
