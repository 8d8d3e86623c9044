"""Which device a worker runs on."""
from __future__ import annotations

import torch

from raylm.configs import ModelConfig


def device_type(model_config: ModelConfig) -> str:
    if model_config.device != "auto":
        if model_config.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device: 'cuda' was asked for but CUDA is not available")
        return model_config.device
    return "cuda" if torch.cuda.is_available() else "cpu"
