"""Resolution as a type (raylm/configs/resolve.py): a pure function of the settings, the checkpoint's facts and the
environment's, handed any machine here as EnvironmentFacts; nothing resolving starts Ray; and every layer follows
the resolved fields instead of deciding again."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from raylm import LLM, SamplingParams
from raylm.cluster.engine.config_resolver import resolve_engine_config
from raylm.cluster.serve.app import llm_server_options, replica_deployment
from raylm.configs import EngineConfig, make_engine_config
from raylm.configs.attention_backends import ATTENTION_BACKENDS
from raylm.configs.bundles import EngineBundles
from raylm.configs.cudagraph_plan import CUDAGraphPlan
from raylm.configs.environment import EnvironmentFacts
from raylm.configs.model_info import ModelInfo, read_model_info
from raylm.configs.resolve import resolve_config
from raylm.executor.abstract import Executor
from raylm.runner.attention import CPUAttentionBackend, FlashAttentionBackend, TorchAttentionBackend
from raylm.runner.attention.triton_backend import TritonAttentionBackend
from raylm.runner.model_runner import ModelRunner
from raylm.runner.models.registry import SUPPORTED_ARCHITECTURES
from raylm.runner.parallel_state import destroy_model_parallel, init_model_parallel
from raylm.worker import Worker
from tests.runner_steps import RUNNER_DEFAULTS, model_parallel_of_one

CPU_HOST = EnvironmentFacts(cpu_count=4, architectures=SUPPORTED_ARCHITECTURES,
                            installed_packages=frozenset({"xgrammar", "llguidance"}))
H100_HOST = dataclasses.replace(CPU_HOST, cuda_devices=8, cuda_capability=(9, 0))
# A CPU head of a cluster of two 4-GPU nodes (a Serve replica given no GPU, a job's driver).
GPU_CLUSTER = dataclasses.replace(CPU_HOST, ray_connected=True,
                                  ray_nodes=({"CPU": 8.0}, {"CPU": 32.0, "GPU": 4.0}, {"CPU": 32.0, "GPU": 4.0}))


def resolve(model_info: ModelInfo, env: EnvironmentFacts, **settings: Any) -> EngineConfig:
    return resolve_config(make_engine_config(model=model_info.path, **settings), model_info, env)


@pytest.fixture(scope="module")
def llama(llama_path: Path) -> ModelInfo:
    return read_model_info(str(llama_path))


def test_a_cpu_host(llama: ModelInfo) -> None:
    resolved = resolve(llama, CPU_HOST).resolved
    assert (resolved.device, resolved.dtype, resolved.quantization) == ("cpu", "float32", "none")
    assert (resolved.attention_backend, resolved.executor_backend) == ("cpu", "uni")
    assert resolved.cudagraph == CUDAGraphPlan("NONE", ())
    assert (resolved.dp_lockstep, resolved.uniform_decode_query_len, resolved.max_concurrent_batches) == (False, 1, 1)
    assert resolved.bundle_layout == EngineBundles({"CPU": 1.0}, ())  # the worker computes in the engine's process
    assert (resolved.routing_policy, resolved.structured_outputs_backends) == ("prefix", ("xgrammar", "guidance"))
    assert resolved.kv_identity.checkpoint == llama.checkpoint[1]
    # Without raylm's CPU kernels: the torch backend; without the grammar packages: a refusal naming the package.
    no_kernels = dataclasses.replace(CPU_HOST, missing_kernels={"cpu": "its kernels could not be built here"})
    assert resolve(llama, no_kernels).resolved.attention_backend == "torch"
    assert resolve(llama, CPU_HOST, custom_ops="none").resolved.attention_backend == "torch"
    with pytest.raises(ValueError, match="attention_backend 'cpu' is not available: its kernels could not be built"):
        resolve(llama, no_kernels, attention_backend="cpu")
    with pytest.raises(ValueError, match="needs the llguidance package, which is not installed"):
        resolve(llama, dataclasses.replace(CPU_HOST, installed_packages=frozenset({"xgrammar"})))
    # Quantized weights compute in bfloat16 on a CPU whose facts name bfloat16 dot products, float32 on one without.
    bf16_cpu = dataclasses.replace(CPU_HOST, cpu_bf16_instructions="AVX512-BF16")
    assert resolve(llama, bf16_cpu, quantization="int8").resolved.dtype == "bfloat16"
    assert resolve(llama, CPU_HOST, quantization="int8").resolved.dtype == "float32"


def test_a_gpu_host(llama: ModelInfo) -> None:
    resolved = resolve(llama, H100_HOST, max_num_seqs=8).resolved
    assert (resolved.device, resolved.dtype, resolved.attention_backend) == ("cuda", "bfloat16", "triton")
    assert resolved.cudagraph == CUDAGraphPlan("FULL_DECODE_ONLY", (1, 2, 4, 8))
    flash = dataclasses.replace(H100_HOST, missing_kernels={"triton": "no triton"})
    assert resolve(llama, flash, block_size=256).resolved.attention_backend == "flash_attn"
    assert resolve(llama, flash).resolved.attention_backend == "torch"  # flash_attn needs pages of 256
    # Speculative decoding: k + 1 query rows per request, and no FULL graphs (the backends capture one-token
    # decodes): decided here, so the engine-config line logs the mode that runs.
    spec = resolve(llama, H100_HOST, speculative_config={"method": "ngram", "num_speculative_tokens": 3}).resolved
    assert spec.uniform_decode_query_len == 4 and spec.cudagraph.mode == "NONE"
    assert "captures one-token decodes only" in spec.cudagraph.why_no_full
    eager = resolve(llama, H100_HOST, speculative_config={"method": "ngram", "num_speculative_tokens": 3},
                    attention_backend="torch", device="cpu", cudagraph_capture_sizes=[2, 5]).resolved
    assert eager.cudagraph.capture_sizes == (4, 8)  # rounded up to whole requests of 4 rows (CPU pads only)


def test_moe_graphs_follow_the_gpu(moe_checkpoints: dict[str, Path]) -> None:
    moe = read_model_info(str(moe_checkpoints["mixtral"]))
    assert resolve(moe, H100_HOST).resolved.cudagraph.mode == "FULL_DECODE_ONLY"
    a100 = dataclasses.replace(H100_HOST, cuda_capability=(8, 0))
    assert "compute capability 9.x or 10.x (here: 8.0)" in resolve(moe, a100).resolved.cudagraph.why_no_full
    lockstep = resolve(moe, H100_HOST, data_parallel_size=2, enable_expert_parallel=True).resolved
    assert (lockstep.dp_lockstep, lockstep.max_concurrent_batches) == (True, 1)


def test_a_cpu_head_of_a_gpu_cluster(llama: ModelInfo) -> None:
    one = resolve(llama, GPU_CLUSTER).resolved
    assert (one.device, one.executor_backend) == ("cuda", "ray")  # its worker on a GPU actor
    assert one.bundle_layout == EngineBundles({"CPU": 1.0}, ({"GPU": 1.0},))
    tp2 = resolve(llama, GPU_CLUSTER, tensor_parallel_size=2, pipeline_parallel_size=2).resolved
    assert tp2.bundle_layout == EngineBundles({"CPU": 1.0}, ({"GPU": 2.0},) * 2, workers_per_bundle=2)
    assert tp2.num_ray_bundles == 5 and tp2.cudagraph.mode == "NONE"  # pipeline stages: eager
    one_gpu_nodes = dataclasses.replace(GPU_CLUSTER, ray_nodes=({"CPU": 8.0, "GPU": 1.0},) * 4)
    tp2 = resolve(llama, one_gpu_nodes, tensor_parallel_size=2).resolved
    assert tp2.bundle_layout.workers == ({"GPU": 1.0},) * 2  # no node holds a TP group: a bundle per device
    with pytest.raises(ValueError, match="'uni' runs the worker in this process, which has no GPU"):
        resolve(llama, GPU_CLUSTER, distributed_executor_backend="uni")


def test_resolving_is_pure(llama: ModelInfo) -> None:
    """One input, one answer: twice the same, and the settings given are not changed."""
    config = make_engine_config(model=llama.path, tensor_parallel_size=2)
    assert resolve_config(config, llama, GPU_CLUSTER) == resolve_config(config, llama, GPU_CLUSTER)
    assert config.resolution is None and config.model_config.max_model_len is None


def test_resolving_starts_no_ray(llama_path: Path) -> None:
    """Tensor parallel on a machine without Ray used to start a local Ray to ask it for GPUs: now the executor starts
    it when it places the workers, and resolving alone, in a fresh process, leaves Ray down."""
    code = ("import ray\n"
            "from raylm.cluster.engine.config_resolver import resolve_engine_config\n"
            "from raylm.configs import make_engine_config\n"
            f"config = resolve_engine_config(make_engine_config(model={str(llama_path)!r}, tensor_parallel_size=2))\n"
            "assert config.resolved.executor_backend == 'ray', config.resolved\n"
            "assert not ray.is_initialized()\n"
            "print('ray down')\n")
    env = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}  # no cluster to join
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0 and "ray down" in done.stdout, done.stderr[-2000:]


def test_the_table_matches_the_backends() -> None:
    """configs/attention_backends.py is the runner's backends as data: their names and graph support agree."""
    backends = [TorchAttentionBackend, CPUAttentionBackend, TritonAttentionBackend, FlashAttentionBackend]
    assert {backend.name: backend.cudagraph_support.name for backend in backends} == {
        name: spec.cudagraph_support for name, spec in ATTENTION_BACKENDS.items()}
    assert ATTENTION_BACKENDS["cpu"].block_size_multiple == CPUAttentionBackend.block_size_multiple


@pytest.mark.usefixtures(model_parallel_of_one.__name__)
def test_every_layer_follows_the_resolved_fields(llama_path: Path) -> None:
    """Change resolved fields after resolution, and every layer follows them instead of deciding again: the runner's
    attention backend, dtype, graph plan and lock-step, the worker's lock-step world, the executor class, the
    engine's batch queue and the executor's step thread, the scheduler's and runner's max_model_len, the Serve
    builder's replica resources."""
    config = resolve_engine_config(make_engine_config(model=str(llama_path), max_num_seqs=4, max_model_len=256,
                                                      record_forwards=True))
    resolved = config.resolved
    assert (resolved.attention_backend, resolved.dtype, resolved.cudagraph.mode) == ("cpu", "float32", "NONE")
    changed = dataclasses.replace(
        config,
        model_config=config.model_config.model_copy(update={"max_model_len": 64}),
        scheduler_config=config.scheduler_config.model_copy(update={"async_scheduling": True}),
        resolution=dataclasses.replace(resolved, attention_backend="torch", dtype="bfloat16",
                                       cudagraph=CUDAGraphPlan("FULL_DECODE_ONLY", (2, 4)), max_concurrent_batches=2))
    llm = LLM.from_engine_config(changed)
    try:
        core = llm.llm_engine.engine_core
        runner = core.executor.worker.model_runner
        assert runner.attn_backend.name == "torch" and runner.dtype == torch.bfloat16
        assert runner.kv_caches[0].dtype == torch.bfloat16
        assert runner.graphs.dispatcher.mode_name == "FULL_DECODE_ONLY"
        assert runner.graphs.dispatcher.capture_sizes == [2, 4] and runner.graphs.enabled
        assert runner.input_batch.max_model_len == 64 and core.scheduler.max_model_len == 64
        assert core.batch_queue is not None and core.batch_queue.maxlen == 2
        assert core.executor._thread is not None  # async scheduling's step thread
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        assert runner.forward_log.counts.padded > 0  # the decodes of one request padded to 2, as the plan says
    finally:
        llm.shutdown()

    lockstep = dataclasses.replace(changed, resolution=dataclasses.replace(changed.resolved, dp_lockstep=True))
    destroy_model_parallel()
    init_model_parallel()
    runner = ModelRunner(lockstep, torch.device("cpu"))
    runner.load_model()
    assert runner.planner is not None and runner.planner.coordinates  # agrees each batch with the other DP ranks
    with pytest.raises(ValueError, match="dp_lockstep is True, but this worker was given a data-parallel world of 1"):
        Worker(lockstep).init_device()
    to_ray = dataclasses.replace(changed, resolution=dataclasses.replace(changed.resolved, executor_backend="ray"))
    assert Executor.get_class(to_ray).__name__ == "RayExecutor"


def test_the_serve_builder_without_ray_leaves_resources_to_the_replica(llama_path: Path) -> None:
    """Without Ray connected as the app is built, the replica asks for no device and resolves its own
    (test_config_resolution.py: with Ray, the builder follows the deployment's device, executor and bundles)."""
    config = make_engine_config(model=str(llama_path), max_replicas=2, **RUNNER_DEFAULTS)
    deployment = replica_deployment(config)
    assert deployment.routing_policy == "prefix"
    options = llm_server_options(config, dataclasses.replace(deployment, device="cuda"))
    assert options["ray_actor_options"]["num_gpus"] == 0 and "placement_group_bundles" not in options
