"""Shared fixtures: tiny checkpoints built by transformers, once per test session."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster.tiny_model import make_tiny_model

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """arch -> folder: random-weight Llama, Qwen2 and Qwen3 checkpoints in the normal HF layout."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        "llama": make_tiny_model(root / "llama", arch="llama", num_layers=2, vocab_size=512),
        "qwen2": make_tiny_model(root / "qwen2", arch="qwen2", num_layers=2, vocab_size=512),
        "qwen3": make_tiny_model(root / "qwen3", arch="qwen3", num_layers=2, vocab_size=512),
    }


@pytest.fixture(scope="session")
def llama_path(checkpoints: dict[str, Path]) -> Path:
    return checkpoints["llama"]
