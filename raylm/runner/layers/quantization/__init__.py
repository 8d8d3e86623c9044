"""Quantized weights: the `quantization` setting (vLLM's field) -> the config that gives every layer its method."""
from __future__ import annotations

from typing import TYPE_CHECKING

from raylm.configs.quant_formats import CHECKPOINT_FORMATS, read_checkpoint_quant
from raylm.runner.layers.quantization.base_config import QuantizationConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["get_quantization_config"]


def get_quantization_config(method: str, hf_config: PretrainedConfig) -> QuantizationConfig | None:
    """The config of `method` for this model, or None for `none`."""
    if method == "none":
        return None
    # A GGUF file's experts load dequantized (runner/models/gguf_weights.py); its linears keep their blocks.
    if method != "gguf" and (getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)):
        architecture = (getattr(hf_config, "architectures", None) or ["this model"])[0]
        raise ValueError(f"quantization {method!r}: the experts of {architecture} (FusedMoE) are not quantized "
                         "yet; use quantization 'none'")
    if method in CHECKPOINT_FORMATS:  # a checkpoint quantized as shipped: its config.json's scheme
        from raylm.runner.layers.quantization.checkpoint_formats import CheckpointQuantConfig

        quant = read_checkpoint_quant(hf_config)
        if quant is None:
            raise ValueError(f"quantization {method!r}: the checkpoint has no quantization_config")
        return CheckpointQuantConfig(quant)
    from raylm.runner.layers.quantization.block_quant import BlockQuantConfig

    return BlockQuantConfig(method, bool(getattr(hf_config, "tie_word_embeddings", False)))
