"""One resolve step, where the engine runs (raylm/cluster/engine/config_resolver.py reads the checkpoint and the
environment, raylm/configs/resolve.py decides): every `auto` and derived decision is made once, and every layer reads
the resolved fields. Ray here declares fake GPUs; no CUDA worker starts."""
from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pydantic
import pytest
import ray
import torch

from raylm.cluster.batch.replica_resources import replica_remote_args
from raylm.cluster.engine.config_resolver import replica_deployment, resolve_engine_config
from raylm.cluster.serve.app import llm_server_options
from raylm.configs import EngineConfig, make_engine_config
from raylm.configs.bundles import EngineBundles
from raylm.configs.model_info import cpu_multiplies_bf16


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


@pytest.mark.parametrize(("gpus", "device", "dtype", "attention"), [
    (2, "cuda", "bfloat16", "triton"),
    (0, "cpu", "bfloat16" if cpu_multiplies_bf16() else "float32", "cpu"),  # resolve_dtype's CPU rule
], indirect=["gpus"])
def test_ray_workers_decide_device_dtype_and_backend(bf16_path: Path, gpus: int, device: str, dtype: str,
                                                     attention: str) -> None:
    """A CPU-only driver of a cluster with GPUs runs CUDA workers in the checkpoint's bfloat16."""
    assert not torch.cuda.is_available(), "the driver has no CUDA"
    config = resolve_engine_config(make_engine_config(model=str(bf16_path), tensor_parallel_size=2,
                                                      max_model_len=128))
    resolved = config.resolved
    assert resolved.num_ray_bundles == 3
    assert (resolved.device, resolved.dtype) == (device, dtype)
    assert config.model_info.checkpoint_dtype == "bfloat16"
    assert resolved.attention_backend == attention
    assert resolved.executor_backend == "ray"
    assert resolved.cudagraph.mode == ("FULL_DECODE_ONLY" if device == "cuda" else "NONE")
    assert resolve_engine_config(config) is config  # resolved once


@pytest.mark.parametrize("gpus", [1], indirect=True)
def test_a_process_without_a_gpu_puts_its_worker_on_ray(bf16_path: Path, gpus: int) -> None:
    """A Serve replica given no GPU (or a job's CPU head) never builds a CPU engine on a GPU cluster by accident: its
    one worker goes to a GPU actor."""
    config = resolve_engine_config(make_engine_config(model=str(bf16_path), max_model_len=128))
    assert config.resolved.device == "cuda" and config.resolved.executor_backend == "ray"
    with pytest.raises(ValueError, match="'uni' runs the worker in this process, which has no GPU"):
        resolve_engine_config(make_engine_config(model=str(bf16_path), distributed_executor_backend="uni"))


@pytest.mark.parametrize("gpus", [2], indirect=True)
def test_replica_builders_give_replicas_what_the_resolver_will_decide(bf16_path: Path, gpus: int) -> None:
    in_process = server_options(make_engine_config(model=str(bf16_path)))
    assert in_process["ray_actor_options"]["num_gpus"] == 1 and "placement_group_bundles" not in in_process
    with_workers = server_options(make_engine_config(model=str(bf16_path), tensor_parallel_size=2))
    assert with_workers["ray_actor_options"]["num_gpus"] == 0
    bundles = with_workers["placement_group_bundles"]
    assert bundles[0].get("GPU", 0) == 0 and sum(bundle.get("GPU", 0) for bundle in bundles) == 2
    # The builder follows the deployment it is given: a worker actor instead of a GPU in the replica, its bundles.
    config = make_engine_config(model=str(bf16_path))
    deployment = replica_deployment(config)
    assert (deployment.device, deployment.executor_backend) == ("cuda", "uni")
    on_ray = dataclasses.replace(deployment, executor_backend="ray",
                                 bundle_layout=EngineBundles({"CPU": 1.0}, ({"GPU": 1.0},)))
    options = llm_server_options(config, on_ray)
    assert options["ray_actor_options"]["num_gpus"] == 0
    assert options["placement_group_bundles"] == [{"CPU": 1.0}, {"GPU": 1.0}]
    # The batch processor's replicas take the same deployment: a GPU for the in-process worker (also with 'uni',
    # which this GPU-less driver could not run itself), and the Serve replica's placement group for TP=2.
    for settings in ({}, {"distributed_executor_backend": "uni"}):
        args = replica_remote_args(make_engine_config(model=str(bf16_path), **settings), None)
        assert (args["num_cpus"], args["num_gpus"]) == (1.0, 1), settings
    batch = replica_remote_args(make_engine_config(model=str(bf16_path), tensor_parallel_size=2), None)
    assert batch["ray_remote_args_fn"].args == (bundles, "PACK")
    assert (batch["num_cpus"], batch["num_gpus"]) == (1.0, 0.0)


def test_serve_builds_without_ray_and_leaves_the_device_to_the_replica(bf16_path: Path) -> None:
    options = server_options(make_engine_config(model=str(bf16_path)))
    assert options["ray_actor_options"]["num_gpus"] == 0 and "placement_group_bundles" not in options
    assert not ray.is_initialized()


def test_in_process_worker_decides_from_local_torch(bf16_path: Path) -> None:
    config = resolve_engine_config(make_engine_config(model=str(bf16_path), max_model_len=128))
    dtype = "bfloat16" if cpu_multiplies_bf16() else "float32"  # resolve_dtype's CPU rule
    assert (config.resolved.device, config.resolved.dtype) == ("cpu", dtype)
    assert config.resolved.executor_backend == "uni"
    assert not ray.is_initialized(), "an in-process worker needs no Ray"


def test_checkpoint_is_checked_on_the_driver(llama_path: Path, tmp_path: Path) -> None:
    """An unsupported architecture or impossible setting fails before any worker is placed."""
    shutil.copytree(llama_path, tmp_path / "gpt2")
    hf = json.loads((tmp_path / "gpt2" / "config.json").read_text())
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({**hf, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'; supported: LlamaForCausalLM"):
        resolve_engine_config(make_engine_config(model=str(tmp_path / "gpt2"), tensor_parallel_size=2))
    with pytest.raises(ValueError, match="enable_expert_parallel: LlamaForCausalLM has no experts"):
        resolve_engine_config(make_engine_config(model=str(llama_path), enable_expert_parallel=True))
    assert not ray.is_initialized()


def test_pipeline_parallel_keeps_async_scheduling_to_the_batch_queue(llama_path: Path) -> None:
    config = resolve_engine_config(make_engine_config(model=str(llama_path), pipeline_parallel_size=2, device="cpu",
                                                      async_scheduling=True))
    assert config.resolved.max_concurrent_batches == 3
    assert not config.scheduler_config.async_scheduling  # no placeholders: stage 0 waits for sampled tokens


def test_a_resolved_config_is_frozen(llama_path: Path) -> None:
    config = resolve_engine_config(make_engine_config(model=str(llama_path)))
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        config.model_config.device = "cuda"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.resolution = None  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.resolved.device = "cuda"  # type: ignore[misc]


def server_options(config: EngineConfig) -> dict[str, Any]:
    return llm_server_options(config, replica_deployment(config))
