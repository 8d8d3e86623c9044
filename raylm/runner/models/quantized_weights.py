"""The tensors of a quantized checkpoint (compressed-tensors, GPTQ, AWQ) gathered per linear and repacked into one
`<module>.weight` (raylm blocks: ggml's, or F8_E4M3 for FP8), so the models' load_weights match them to parameters
as any other weight. A linear missing one of its format's tensors is refused naming the tensor."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from raylm.configs.quant_formats import CheckpointQuant
from raylm.runner.layers.quantization.checkpoint_repack import repack
from raylm.runner.layers.quantization.ggml_blocks import QuantizedTensor

_EIGHT_BIT = (torch.int8, torch.float8_e4m3fn)


def format_tensors(quant: CheckpointQuant) -> tuple[set[str], set[str]]:
    """(required, optional) tensor suffixes of one quantized linear in `quant`'s layout."""
    if quant.method in ("gptq", "awq"):
        return {"qweight", "qzeros", "scales"}, ({"g_idx"} if quant.method == "gptq" else set())
    if quant.layout == "pack-quantized":
        required = {"weight_packed", "weight_scale", "weight_shape"}
        required |= set() if quant.symmetric else {"weight_zero_point"}
        return required | ({"weight_g_idx"} if quant.act_order else set()), set()
    return {"weight", "weight_scale"}, set()


def iterate_quantized_weights(weights: Iterable[tuple[str, torch.Tensor]], quant: CheckpointQuant
                              ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """`weights` with each quantized linear's tensors replaced by one repacked `<module>.weight`, yielded once its
    tensors are all read (a module's tensors may lie in different safetensors files)."""
    required, optional = format_tensors(quant)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        module, _, suffix = name.rpartition(".")
        quantized_weight = suffix == "weight" and "weight" in required and tensor.dtype in _EIGHT_BIT
        if suffix not in (required | optional) - {"weight"} and not quantized_weight:
            yield name, tensor
            continue
        if module.endswith("lm_head") or module.endswith("embed_tokens"):
            raise ValueError(f"checkpoint tensor {name}: raylm keeps the embedding and LM head of a {quant.method} "
                             "checkpoint float (quantize linear layers only)")
        parts = pending.setdefault(module, {})
        parts[suffix] = tensor
        if parts.keys() >= required | optional:
            yield f"{module}.weight", repack(module, pending.pop(module), quant)
    for module, parts in pending.items():
        missing = sorted(required - parts.keys())
        if missing:
            raise ValueError(f"checkpoint tensor {module}.{missing[0]} is missing: a {quant.method} "
                             f"{quant.layout} linear needs {', '.join(sorted(required))} (it has "
                             f"{', '.join(sorted(parts))})")
        yield f"{module}.weight", repack(module, parts, quant)
