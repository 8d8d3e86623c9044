"""A pooling request's settings checked against the model and completed from its pooler config, before the request
reaches the scheduler (vLLM's PoolingParams.verify): what the user left unset is the model's, what the model cannot
do is a ValueError naming the field."""
from __future__ import annotations

import dataclasses

from raylm.common.pooling_params import PoolingParams
from raylm.configs import EngineConfig


def check_pooling_params(params: PoolingParams, config: EngineConfig) -> PoolingParams:
    pooler = config.pooler_config
    assert pooler is not None and pooler.pooling_type is not None, "resolution sets the model's pooler config"
    if config.speculative_config is not None:
        raise ValueError("embeddings are not served by an engine with speculative_config: its draft steps would "
                         "treat a pooling request as one that samples; serve the embedding model without it")
    if params.dimensions is not None:
        check_dimensions(params.dimensions, config)
    return dataclasses.replace(
        params, pooling_type=params.pooling_type or pooler.pooling_type,
        normalize=pooler.normalize if params.normalize is None else params.normalize)


def check_dimensions(dimensions: int, config: EngineConfig) -> None:
    """Matryoshka models (config.json's `is_matryoshka` or `matryoshka_dimensions`) keep a prefix of the vector;
    others refuse, as vLLM does, since a cut vector of theirs means little. vLLM's words."""
    hf_config = config.model_info.hf_config
    supported = getattr(hf_config, "matryoshka_dimensions", None)
    if not (getattr(hf_config, "is_matryoshka", False) or supported):
        raise ValueError(f"dimensions: model {config.model_info.path!r} does not support matryoshka representation "
                         f"(its config.json has no is_matryoshka or matryoshka_dimensions), changing output "
                         f"dimensions will lead to poor results; leave dimensions out")
    if supported and dimensions not in supported:
        raise ValueError(f"dimensions: model {config.model_info.path!r} only supports {list(supported)} matryoshka "
                         f"dimensions, got {dimensions}; using other output dimensions will lead to poor results")
    hidden_size = getattr(hf_config, "hidden_size", None)
    if hidden_size is not None and dimensions > hidden_size:
        raise ValueError(f"dimensions: {dimensions} is more than the model's hidden size ({hidden_size})")
