"""Build a model on its device and dtype and stream its weights from a Hugging Face safetensors checkpoint or a GGUF
file, with its `quantization` method."""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from torch import nn

from raylm.configs.gguf_metadata import is_gguf
from raylm.configs.quant_formats import read_checkpoint_quant
from raylm.runner.layers.gemm_plans import plan_linears
from raylm.runner.layers.quantization import get_quantization_config
from raylm.runner.layers.quantization.base_config import set_quant_config
from raylm.runner.layers.quantization.block_quant import BlockQuantMethod
from raylm.runner.layers.quantization.ggml_blocks import QuantizedTensor
from raylm.runner.models.gguf_weights import iterate_gguf_weights
from raylm.runner.models.llama import LlamaForCausalLM
from raylm.runner.models.quantized_weights import iterate_quantized_weights
from raylm.runner.models.registry import get_model_cls
from raylm.runner.models.utils import pp_missing_prefixes

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
# Names of a bare decoder checkpoint (saved from `Qwen3Model` rather than `Qwen3ForCausalLM`, as Qwen3-Embedding is):
# the same weights without the `model.` prefix, and no lm_head where the embeddings are tied.
_BARE_DECODER_PREFIXES = ("embed_tokens.", "layers.", "norm.")


def safetensors_files(model_path: str | Path) -> list[Path]:
    path = Path(model_path)
    if (path / SAFE_WEIGHTS_INDEX_NAME).exists():
        weight_map = json.loads((path / SAFE_WEIGHTS_INDEX_NAME).read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    if (path / SAFE_WEIGHTS_NAME).exists():
        return [path / SAFE_WEIGHTS_NAME]
    raise FileNotFoundError(f"no {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME} in {path}")


def iterate_weights(model_path: str | Path, skip: Callable[[str], bool] = lambda name: False
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every checkpoint weight not skipped, named as in a *ForCausalLM checkpoint (a bare
    decoder's names get their `model.` prefix); skipped ones are never read."""
    for file in safetensors_files(model_path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for stored in f.keys():
                name = f"model.{stored}" if stored.startswith(_BARE_DECODER_PREFIXES) else stored
                if not skip(name):
                    yield name, f.get_tensor(stored)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def checkpoint_weights(model: LlamaForCausalLM, model_path: str | Path
                       ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """The checkpoint's weights for `model`'s pipeline stage: safetensors, or a GGUF file's tensors (packed blocks
    for the layers that keep them)."""
    prefixes = pp_missing_prefixes(model)
    if is_gguf(model_path):
        return iterate_gguf_weights(model_path, model.config, packed_checkpoint_names(model),
                                    skip=lambda name: name.startswith(prefixes))
    weights = iterate_weights(model_path, skip=lambda name: name.startswith(prefixes))
    quant = read_checkpoint_quant(model.config)  # compressed-tensors / GPTQ / AWQ: repacked per linear
    return weights if quant is None else iterate_quantized_weights(weights, quant)


def packed_checkpoint_names(model: nn.Module) -> set[str]:
    """Checkpoint names of the weights that load into block-quantized layers (a fused layer's parts by name)."""
    parts = getattr(model, "packed_modules_mapping", {})
    names: set[str] = set()
    for prefix, module in model.named_modules():
        if isinstance(getattr(module, "quant_method", None), BlockQuantMethod):
            head, _, last = prefix.rpartition(".")
            names.update(f"{head}.{part}.weight" if head else f"{part}.weight" for part in parts.get(last, [last]))
    return names


def load_model(model_path: str | Path, hf_config: PretrainedConfig, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", pp_rank: int = 0, pp_size: int = 1,
               partition: list[int] | None = None, quantization: str = "none") -> LlamaForCausalLM:
    """The model of pipeline stage `pp_rank` (TP sharding from runner.parallel_state), built from `hf_config` (the
    checkpoint's config, read once with the engine's ModelInfo), weights loaded, in eval mode. `quantization`: the
    resolved setting (none, int8, int4 or gguf; config_resolver decides it). Raises if the checkpoint lacks a weight
    the stage needs."""
    model_cls = get_model_cls(hf_config)
    quant_config = get_quantization_config(quantization, hf_config)
    with _default_dtype(dtype), torch.device(device), set_quant_config(quant_config):
        model = model_cls(hf_config, pp_rank=pp_rank, pp_size=pp_size, partition=partition)
    loaded = model.load_weights(checkpoint_weights(model, model_path))
    missing = sorted(name for name, _ in model.named_parameters() if name not in loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint {model_path} lacks weights for {type(model).__name__}: {shown}")
    for module in model.modules():
        process = getattr(module, "process_weights_after_loading", None)
        if process is not None:
            process()
    if torch.device(device).type == "cpu":
        plan_linears(model)
    return model.eval()


def reload_weights(model: LlamaForCausalLM, model_path: str | Path) -> None:
    """Load the checkpoint's weights again into `model`'s allocated parameters (sleep level 2's wake-up)."""
    model.load_weights(checkpoint_weights(model, model_path))
