"""raylm.data's processor: a replica's engine fed every row of the batches it holds at once, and a TP=2 replica in a
placement group of its own whose rows equal LLM.generate on the same rows (greedy, token-exact). Two replicas on two
nodes, and an autoscaling pool: tests/test_batch_multinode.py."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import ray

from raylm.cluster.batch.engine_stage import EngineStageUDF
from raylm.cluster.entrypoints.llm import LLM
from raylm.common.sampling_params import SamplingParams
from raylm.configs import make_engine_config
from raylm.data import EngineProcessorConfig, build_processor

REPO_ROOT = Path(__file__).resolve().parents[1]
# Ray's workers import this module's row functions by name.
RUNTIME_ENV = {"env_vars": {"PYTHONPATH": f"{REPO_ROOT}:{REPO_ROOT / 'tests'}"}}
ENGINE = {"max_model_len": 128, "num_gpu_blocks_override": 128, "max_num_seqs": 64, "block_size": 16}
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def prompt_of(i: int) -> str:
    return f"row {i}: " + " ".join(str(i * k % 97) for k in range(1 + i % 7))


def messages_of(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt_of(i)}]


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    # More CPUs declared than the 2 cores: replicas and Ray Data's tasks share them through their thread counts.
    ray.init(address="local", num_cpus=8, include_dashboard=False, runtime_env=RUNTIME_ENV)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(llama_path: Path) -> dict[int, list[int]]:
    """id -> LLM.generate's tokens: even ids as prompts, odd ids as chat messages (LLM.chat)."""
    llm = LLM(model=str(llama_path), distributed_executor_backend="uni", **ENGINE)
    try:
        ids = range(24)
        params = SamplingParams(**GREEDY)
        prompts = llm.generate([prompt_of(i) for i in ids if i % 2 == 0], params, use_tqdm=False)
        chats = llm.chat([messages_of(i) for i in ids if i % 2 == 1], params, use_tqdm=False)
    finally:
        llm.shutdown()
    outputs = iter(prompts), iter(chats)
    return {i: next(outputs[i % 2]).outputs[0].token_ids for i in ids}


def to_request(row: dict[str, Any]) -> dict[str, Any]:
    i = row["id"]
    return {"id": i, **({"prompt": prompt_of(i)} if i % 2 == 0 else {"messages": messages_of(i)}),
            "sampling_params": GREEDY}


def test_replica_feeds_all_rows_of_its_batches_at_once(llama_path: Path) -> None:
    """Two batches of 8 given to one replica at once (as Ray Data does with max_concurrent_batches=2): the engine runs
    all 16 rows together, not a batch, let alone a row, at a time."""
    udf = EngineStageUDF(make_engine_config(model=str(llama_path), distributed_executor_backend="uni", **ENGINE),
                         apply_chat_template=True, should_continue_on_error=False)
    batches = [pa.Table.from_pylist([{"id": 8 * b + i, "prompt": prompt_of(8 * b + i),
                                      "sampling_params": GREEDY | {"max_tokens": 24}} for i in range(8)])
               for b in range(2)]
    peak = 0

    async def run() -> list[pa.Table]:
        nonlocal peak

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, udf.engine.scheduler_stats.num_running_reqs)
                await asyncio.sleep(0.002)

        watcher = asyncio.ensure_future(watch())
        try:
            return await asyncio.gather(*[_first(udf(batch)) for batch in batches])
        finally:
            watcher.cancel()

    try:
        tables = asyncio.run(run())
    finally:
        udf.engine.shutdown()
    assert [table.num_rows for table in tables] == [8, 8]
    assert peak == 16
    # The replica takes each row's final output only; the first token's time comes with it, 23 steps before the end.
    rows = [row for table in tables for row in table.to_pylist()]
    assert all(0 < row["time_to_first_token"] < row["time_taken_llm"] for row in rows)


async def _first(outputs: Any) -> pa.Table:
    return [table async for table in outputs][0]


def test_tp2_replica_in_its_own_placement_group(local_ray: None, llama_path: Path,
                                                reference: dict[int, list[int]]) -> None:
    config = EngineProcessorConfig(model_source=str(llama_path), engine_kwargs=ENGINE | {"tensor_parallel_size": 2},
                                   concurrency=1, batch_size=8)
    rows = build_processor(config, preprocess=to_request)(ray.data.range(24)).take_all()
    assert {row["id"]: list(row["generated_tokens"]) for row in rows} == {i: reference[i] for i in range(24)}
    groups = [group for group in ray.util.placement_group_table().values() if group["state"] == "CREATED"]
    # The replica's own group: the engine's bundle, then its 2 TP workers' (one bundle of the TP group, or one each).
    assert any(group["bundles"][0] == {"CPU": 1.0} and sum(b.get("CPU", 0) for b in group["bundles"].values()) == 3
               for group in groups), groups


def test_bad_settings_fail_when_the_processor_is_built(llama_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown setting"):
        build_processor(EngineProcessorConfig(model_source=str(llama_path), engine_kwargs={"max_model_lenn": 64}))
    with pytest.raises(ValueError, match="concurrency"):
        EngineProcessorConfig(concurrency=(3, 2))
    with pytest.raises(ValueError, match="data_parallel_size=2"):
        build_processor(EngineProcessorConfig(model_source=str(llama_path), engine_kwargs={"data_parallel_size": 2}))
