"""The Ray executor end to end on a local Ray (CPU, gloo): TP, PP, TP x PP and an uneven PP split give the
single-device engine's greedy tokens (and transformers'), with async scheduling on and off, chunked prefill and
preemption; a killed worker fails the engine fast; shutdown leaves nothing behind."""
from __future__ import annotations

import argparse
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.engine.llm_engine import LLMEngine
from raylm.cluster.models.tiny_model import make_tiny_model
from raylm.common.outputs import SchedulerOutput
from raylm.configs import ParallelConfig, add_engine_args, engine_args_from, make_engine_config
from raylm.configs.bundles import engine_bundles
from raylm.executor import Executor, UniProcExecutor
from raylm.executor.placement import assign_ranks
from raylm.executor.ray_executor import RayExecutor
from raylm.executor.ray_worker import cuda_device_index
from tests.reference import TOP_K, assert_same_output, check_logprobs_close, hf_greedy
from tests.runner_steps import resolved_config

MAX_TOKENS = 12
PROMPT_LENGTHS = [1, 6, 19, 35]
# Chunked prefill (16-token steps) over a KV pool too small for all four requests at once: preemption included.
ENGINE = dict(max_model_len=128, block_size=4, max_num_batched_tokens=16, max_num_seqs=4, num_gpu_blocks_override=20,
              enable_prefix_caching=False)
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "tp2_pp2": (2, 2), "pp3": (1, 3)}
Result = list[tuple[list[int], list[dict[int, float]]]]



@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("ray") / "llama5", num_layers=5, hidden_size=64,
                           intermediate_size=128, vocab_size=512)


def make_prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(5, 512) for _ in range(n)] for n in PROMPT_LENGTHS]


def generate(llm: LLM) -> Result:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)
    outputs = llm.generate([{"prompt_token_ids": p} for p in make_prompts()], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


@pytest.fixture(scope="module")
def single_device(model_path: Path) -> Result:
    """The uni engine's output; with async scheduling (a step thread) it must be the same."""
    results = []
    for async_scheduling in (False, True):
        llm = LLM(model=str(model_path), async_scheduling=async_scheduling, **ENGINE)
        results.append(generate(llm))
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
        llm.shutdown()
    assert_same_output(results[1], results[0])
    return results[0]


@pytest.fixture(scope="module")
def transformers(model_path: Path, single_device: Result) -> Result:
    reference = hf_greedy(model_path, make_prompts(), MAX_TOKENS)
    assert check_logprobs_close(reference, single_device, "single device") <= 1
    return reference


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def actor_exists(name: str) -> bool:
    try:
        ray.get_actor(name)
    except ValueError:
        return False
    return True


def assert_released(executor: RayExecutor) -> None:
    """No worker actor and no placement group of this executor is left."""
    assert executor.plan is not None
    placement_group = executor.plan.placement_group
    wait_until(lambda: ray.util.placement_group_table(placement_group)["state"] == "REMOVED")
    wait_until(lambda: not any(actor_exists(name) for name in executor.actor_names))


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_layouts_match_single_device(layout: str, async_scheduling: bool, ray_cluster: Any,
                                              model_path: Path, single_device: Result, transformers: Result) -> None:
    tp, pp = LAYOUTS[layout]
    # PP=2 runs once with the default split (3 + 2 layers) and once with an override.
    partition = [4, 1] if layout == "pp2" and async_scheduling else None
    llm = LLM(model=str(model_path), tensor_parallel_size=tp, pipeline_parallel_size=pp,
              distributed_executor_backend="ray", async_scheduling=async_scheduling, pp_layer_partition=partition,
              **ENGINE)
    executor = llm.llm_engine.engine_core.executor
    assert isinstance(executor, RayExecutor)
    depth = llm.llm_engine.config.resolved.max_concurrent_batches
    assert depth == pp + async_scheduling
    layers = executor.collective_rpc(lambda worker: (worker.model_runner.model.model.start_layer,
                                                     worker.model_runner.model.model.end_layer))
    split = [(0, 4), (4, 5)] if partition else {1: [(0, 5)], 2: [(0, 3), (3, 5)], 3: [(0, 2), (2, 4), (4, 5)]}[pp]
    assert layers == [stage for stage in split for _ in range(tp)]  # ranks in order: TP innermost

    engine_core = llm.llm_engine.engine_core
    in_flight_at_schedule: list[int] = []  # with a batch queue, steps are planned while earlier ones run
    schedule = engine_core.scheduler.schedule

    def counting_schedule() -> SchedulerOutput:
        in_flight_at_schedule.append(len(engine_core.batch_queue or ()))
        return schedule()
    engine_core.scheduler.schedule = counting_schedule

    ours = generate(llm)
    assert (max(in_flight_at_schedule) > 0) == (depth > 1)
    assert engine_core.scheduler.num_preemptions > 0
    llm.shutdown()
    assert_released(executor)

    assert_same_output(ours, single_device)
    assert check_logprobs_close(transformers, ours, f"{layout}/{'async' if async_scheduling else 'sync'}") <= 1


@pytest.mark.slow
def test_killed_worker_fails_the_engine_fast(ray_cluster: Any, model_path: Path) -> None:
    engine = LLMEngine(make_engine_config(model=str(model_path), tensor_parallel_size=2, async_scheduling=True,
                                          max_model_len=128, max_num_batched_tokens=16))
    executor = engine.engine_core.executor
    assert isinstance(executor, RayExecutor)
    with pytest.raises(RuntimeError, match=r"(?s)worker rank [01] .*ZeroDivisionError"):  # fails that call only
        executor.collective_rpc(lambda worker: 1 / 0)
    assert executor.collective_rpc("check_health") == [True, True]

    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    for i, prompt in enumerate(make_prompts()):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    for _ in range(4):
        engine.step()
    def slow_steps(worker: Any) -> None:  # local, so that cloudpickle ships it by value
        execute_model = worker.execute_model

        def slow_execute_model(scheduler_output: Any) -> Any:
            time.sleep(0.5)
            return execute_model(scheduler_output)
        worker.execute_model = slow_execute_model

    executor.collective_rpc(slow_steps)
    # The engine is blocked on a step (and has another in flight) when the worker dies.
    threading.Timer(0.2, ray.kill, (executor.workers[1],)).start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker rank 1 "):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < 10
    with pytest.raises(RuntimeError, match="worker rank 1 "):
        engine.engine_core.check_health()
    engine.add_request("late", {"prompt_token_ids": [7, 8, 9]}, params)  # new requests fail at once too
    with pytest.raises(RuntimeError, match="worker rank 1 "):
        engine.step()
    engine.shutdown()
    assert_released(executor)


@pytest.mark.slow
def test_monitor_notices_an_idle_dead_worker(ray_cluster: Any, model_path: Path) -> None:
    llm = LLM(model=str(model_path), distributed_executor_backend="ray", max_model_len=128)
    executor = llm.llm_engine.engine_core.executor
    assert isinstance(executor, RayExecutor) and executor.rpc is not None
    executor.check_health()
    ray.kill(executor.workers[0])
    wait_until(lambda: executor.rpc.failure is not None, timeout=5.0)  # no call was made: the monitor thread saw it
    with pytest.raises(RuntimeError, match=r"worker rank 0 .* died"):
        llm.llm_engine.engine_core.check_health()
    with pytest.raises(RuntimeError, match="worker rank 0 "):
        llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    llm.shutdown()
    assert_released(executor)


def test_bundles_sorted_engine_node_first_then_by_node() -> None:
    bundle_nodes = {1: "node-b", 2: "node-a", 3: "engine", 4: "node-b", 5: "engine", 6: "node-a"}
    assert assign_ranks(bundle_nodes, 1, 1, "engine") == [3, 5, 2, 6, 1, 4]
    tp2 = ParallelConfig(tensor_parallel_size=2)
    assert engine_bundles(tp2, "cuda", None).bundles == [{"CPU": 1.0}, {"GPU": 1.0}, {"GPU": 1.0}]
    assert engine_bundles(ParallelConfig(), "cpu", None).bundles == [{"CPU": 1.0}, {"CPU": 1.0}]


@pytest.mark.parametrize(("ray_gpu_id", "visible", "index"), [("3", None, 3), ("3", "3", 0), ("3", "1,3", 1),
                                                                ("10", "2,10,9", 1)])
def test_cuda_device_index_from_ray_gpu_id(ray_gpu_id: str, visible: str | None, index: int) -> None:
    assert cuda_device_index(ray_gpu_id, visible) == index


def test_cuda_device_index_rejects_a_hidden_gpu() -> None:
    with pytest.raises(RuntimeError, match="hides it"):
        cuda_device_index("2", "0,1")


def test_parallel_settings_from_cli_and_executor_choice(model_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = "--tensor-parallel-size 2 --pipeline-parallel-size 2 --distributed-executor-backend ray " \
            "--pp-layer-partition 3 2 --placement-group-strategy SPREAD"
    config = make_engine_config(**engine_args_from(parser.parse_args(flags.split())))
    parallel = config.parallel_config
    assert (parallel.world_size, parallel.pp_layer_partition) == (4, [3, 2])
    assert (parallel.distributed_executor_backend, parallel.placement_group_strategy) == ("ray", "SPREAD")

    def executor_class(**settings: Any) -> type[Executor]:
        return Executor.get_class(resolved_config(model=str(model_path), device="cpu", **settings))

    assert executor_class(tensor_parallel_size=2) is RayExecutor  # the default for > 1 device
    assert executor_class() is UniProcExecutor
    with pytest.raises(ValueError, match="use 'ray'"):
        executor_class(pipeline_parallel_size=2, distributed_executor_backend="uni")
