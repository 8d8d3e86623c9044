"""Shared fixtures: tiny checkpoints built by transformers, once per test session."""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

# Without an NVIDIA GPU the Triton kernels' tests run in Triton's interpreter, which must be on before triton is first
# imported (torch imports it): set after that, the test modules that need it skipped themselves in the full suite.
if not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from raylm.cluster.models.tiny_model import make_tiny_model
from raylm.runner import cpu_kernels

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


@pytest.fixture(autouse=True)
def _cpu_kernels_back_on() -> Iterator[None]:
    """A runner built with custom_ops="none" switches raylm's CPU kernels off for its whole process: switch them back
    on after each test, so a later test's backend does not depend on which tests ran before it."""
    yield
    cpu_kernels.set_enabled(True)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A local Ray for one test module, with more CPUs declared than the machine has: CPU workers share the cores
    through torch's thread count. A module that needs other resources starts its own Ray instead. Ray is imported
    here only, so that the GPU tests run where Ray is not installed."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=8, include_dashboard=False)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def llama_path(checkpoints: dict[str, Path]) -> Path:
    return checkpoints["llama"]


@pytest.fixture(scope="session")
def moe_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """arch -> folder: random-weight Mixtral and Qwen3-MoE checkpoints (4 experts, top-2, per-expert weight layout);
    the Qwen3-MoE one has a dense first layer and does not renormalise its top-k weights."""
    root = tmp_path_factory.mktemp("moe_checkpoints")
    common = dict(num_layers=2, hidden_size=64, intermediate_size=128, vocab_size=512, num_experts=4,
                  num_experts_per_tok=2)
    return {
        "mixtral": make_tiny_model(root / "mixtral", arch="mixtral", **common),
        "qwen3_moe": make_tiny_model(root / "qwen3_moe", arch="qwen3_moe", moe_intermediate_size=64,
                                     mlp_only_layers=[0], norm_topk_prob=False, **common),
    }
