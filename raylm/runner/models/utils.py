"""Helpers shared by the model files: pipeline-parallel layer placement and config reading."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from raylm.common.outputs import IntermediateTensors

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class PPMissingLayer(nn.Identity):
    """Placeholder for a module another pipeline stage owns; keeps the global module names."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else None


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int,
                   partition: list[int] | None = None) -> tuple[int, int]:
    """[start, end) of the layers stage `pp_rank` owns. Even split; spare layers go to the stages before the
    last (which also carries the norm and LM head), filled from the second-to-last backwards."""
    assert 0 <= pp_rank < pp_size
    if partition is None:
        if num_layers < pp_size:
            raise ValueError(f"{num_layers} layers cannot be split over {pp_size} pipeline stages")
        partition = [num_layers // pp_size] * pp_size
        for i in range(num_layers % pp_size):
            partition[-2 - i] += 1
    elif len(partition) != pp_size or sum(partition) != num_layers or min(partition) < 1:
        raise ValueError(f"layer partition {partition} must have {pp_size} entries >= 1 summing to {num_layers}")
    start = sum(partition[:pp_rank])
    return start, start + partition[pp_rank]


def make_layers(num_layers: int, layer_fn: Callable[[int], nn.Module], pp_rank: int = 0, pp_size: int = 1,
                partition: list[int] | None = None) -> tuple[int, int, nn.ModuleList]:
    """A full-length ModuleList: `layer_fn(i)` for the layers this stage owns, PPMissingLayer elsewhere."""
    start, end = get_pp_indices(num_layers, pp_rank, pp_size, partition)
    modules = nn.ModuleList(layer_fn(i) if start <= i < end else PPMissingLayer() for i in range(num_layers))
    return start, end, modules


def pp_missing_prefixes(model: nn.Module) -> tuple[str, ...]:
    return tuple(f"{name}." for name, module in model.named_modules() if isinstance(module, PPMissingLayer))


def is_pp_missing_parameter(name: str, model: nn.Module) -> bool:
    """Whether checkpoint weight `name` belongs to a module another pipeline stage owns."""
    return name.startswith(pp_missing_prefixes(model))


def get_rope_config(config: PretrainedConfig) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope scaling dict or None). transformers 5 keeps both, and partial_rotary_factor, in
    `rope_parameters`; older versions in `rope_theta`, `rope_scaling` and `partial_rotary_factor`."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    theta = params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    params.setdefault("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    return float(theta), (params if rope_type != "default" or params["partial_rotary_factor"] != 1.0 else None)


def get_head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def make_empty_intermediate_tensors(num_tokens: int, hidden_size: int, dtype: torch.dtype,
                                    device: torch.device | str) -> IntermediateTensors:
    """Zero {hidden_states, residual} buffers of the size a pipeline stage sends."""
    return IntermediateTensors({key: torch.zeros(num_tokens, hidden_size, dtype=dtype, device=device)
                                for key in ("hidden_states", "residual")})
