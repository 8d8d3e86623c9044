"""The device (and so the dtype "auto") is decided once, from where the workers run, not from the driver's torch: a
CPU-only driver of a Ray cluster with GPUs runs CUDA workers in bfloat16. Ray here declares fake GPUs; no CUDA worker
starts."""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

import raylm.cluster.llm_engine
from raylm.cluster.llm_engine import LLMEngine
from raylm.configs import make_engine_config
from raylm.executor.device import decide_device


@pytest.fixture(scope="module")
def bf16_path(llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bf16") / "llama"
    shutil.copytree(llama_path, path)
    hf = json.loads((path / "config.json").read_text())
    hf.pop("dtype", None)
    hf["torch_dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(hf))
    return path


@pytest.fixture
def gpus(request: pytest.FixtureRequest) -> Iterator[int]:
    assert not ray.is_initialized(), "this module starts its own Ray, with GPUs declared"
    ray.init(address="local", num_cpus=4, num_gpus=request.param, include_dashboard=False)
    yield request.param
    ray.shutdown()


class _CapturingEngineCore:
    """Stands in for EngineCore: keeps the config that would go to the executor and its workers."""

    num_engines = 1
    seen: list[Any] = []

    def __init__(self, config: Any, model_info: Any) -> None:
        _CapturingEngineCore.seen.append((config, model_info))


@pytest.mark.parametrize(("gpus", "device", "dtype"), [(2, "cuda", "bfloat16"), (0, "cpu", "float32")],
                         indirect=["gpus"])
def test_ray_workers_decide_device_and_dtype(bf16_path: Path, gpus: int, device: str, dtype: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    assert not torch.cuda.is_available(), "the driver has no CUDA"
    config = make_engine_config(model=str(bf16_path), tensor_parallel_size=2, max_model_len=128)
    assert decide_device(config).model_config.device == device
    monkeypatch.setattr(raylm.cluster.llm_engine, "EngineCore", _CapturingEngineCore)
    _CapturingEngineCore.seen.clear()
    engine = LLMEngine(config)
    handed, model_info = _CapturingEngineCore.seen[0]
    assert handed.model_config.device == device and engine.config.model_config.device == device
    assert model_info.dtype == dtype == engine.model_info.dtype


def test_in_process_worker_decides_from_local_torch(bf16_path: Path) -> None:
    config = make_engine_config(model=str(bf16_path), distributed_executor_backend="uni", max_model_len=128)
    assert decide_device(config).model_config.device == "cpu"
    assert not ray.is_initialized(), "an in-process worker needs no Ray"


@pytest.mark.parametrize("gpus", [1], indirect=True)
def test_serve_replica_uses_the_same_decision(bf16_path: Path, gpus: int) -> None:
    from raylm.cluster.serve import _replica_holds_device

    assert _replica_holds_device(make_engine_config(model=str(bf16_path), distributed_executor_backend="uni"))
    assert not _replica_holds_device(make_engine_config(model=str(bf16_path), tensor_parallel_size=2))
