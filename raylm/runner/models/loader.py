"""Build a model on its device and dtype and stream its weights from a Hugging Face safetensors checkpoint."""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from torch import nn

from raylm.runner.layers.cpu_gemm import plan_linears
from raylm.runner.models.registry import get_model_cls
from raylm.runner.models.utils import pp_missing_prefixes

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


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
    """(name, CPU tensor) for every checkpoint weight not skipped; skipped ones are never read."""
    for file in safetensors_files(model_path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if not skip(name):
                    yield name, f.get_tensor(name)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(model_path: str | Path, hf_config: PretrainedConfig, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", pp_rank: int = 0, pp_size: int = 1,
               partition: list[int] | None = None) -> nn.Module:
    """The model of pipeline stage `pp_rank` (TP sharding from runner.parallel_state), built from `hf_config` (the
    checkpoint's config, read once with the engine's ModelInfo), weights loaded, in eval mode. Raises if the
    checkpoint lacks a weight the stage needs."""
    model_cls = get_model_cls(hf_config)
    with _default_dtype(dtype), torch.device(device):
        model = model_cls(hf_config, pp_rank=pp_rank, pp_size=pp_size, partition=partition)
    prefixes = pp_missing_prefixes(model)
    loaded = model.load_weights(iterate_weights(model_path, skip=lambda name: name.startswith(prefixes)))
    missing = sorted(name for name, _ in model.named_parameters() if name not in loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint {model_path} lacks weights for {type(model).__name__}: {shown}")
    for module in model.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    if torch.device(device).type == "cpu":
        plan_linears(model)
    return model.eval()


def reload_weights(model: nn.Module, model_path: str | Path) -> None:
    """Load the checkpoint's weights again into `model`'s allocated parameters (sleep level 2's wake-up)."""
    prefixes = pp_missing_prefixes(model)
    model.load_weights(iterate_weights(model_path, skip=lambda name: name.startswith(prefixes)))
