"""vLLM's quantization interfaces: a QuantizationConfig picks a QuantizeMethodBase per layer, which creates the layer's
weights, runs the layer and reworks the weights after loading. The models pass nothing: the loader builds a model
inside `set_quant_config(config)` and every linear or embedding layer asks `current_quant_config()` when it is made."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

# `weight_loader(param, loaded_weight, shard_id=None)`: copies this rank's shard of a full checkpoint tensor into param.
WeightLoader = Callable[..., None]


class QuantizeMethodBase(ABC):
    """How one layer holds and applies its weight."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_size_per_partition: int,
                       weight_loader: WeightLoader) -> None:
        """Register `layer.weight` for this rank's shard ([output, input] rows of the full weight), with
        `weight_loader(param, loaded_weight, shard_id)` as its loader (the layer's sharding)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """y = x W^T (+ bias) for this rank's shard."""

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight (an embedding lookup)."""
        raise NotImplementedError(f"{type(self).__name__} does not serve embedding lookups")

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 - most methods need nothing
        """Rework the loaded weight for the kernels (again after sleep mode's wake-up)."""

    def kernel_name(self, layer: nn.Module) -> str:
        return type(self).__name__

    def changes_input(self, layer: nn.Module) -> bool:
        """Whether `apply` reworks x before its GEMM (an input permutation, quantized activations): a fused kernel
        that reads only the layer's weights would skip that, so it must leave such a layer to `apply`."""
        return False


class QuantizationConfig(ABC):
    """The `quantization` setting of one model: which method each layer gets."""

    name: str

    @abstractmethod
    def get_quant_method(self, layer: nn.Module) -> QuantizeMethodBase | None:
        """The layer's method, or None for the unquantized one."""


_current: QuantizationConfig | None = None


@contextmanager
def set_quant_config(config: QuantizationConfig | None) -> Iterator[None]:
    """Layers made inside take their methods from `config` (None: unquantized)."""
    global _current
    previous, _current = _current, config
    try:
        yield
    finally:
        _current = previous


def current_quant_config() -> QuantizationConfig | None:
    return _current
