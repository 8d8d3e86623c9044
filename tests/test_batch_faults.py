"""Faults in a processor run: a replica killed mid-run (its batches retried, every row exactly once in the output) and
bad rows (an error in the row with should_continue_on_error, else the job fails naming the row)."""
from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray._private.state import actors

from raylm.cluster.entrypoints.llm import LLM
from raylm.common.sampling_params import SamplingParams
from raylm.data import EngineProcessorConfig, build_processor

REPO_ROOT = Path(__file__).resolve().parents[1]
RUNTIME_ENV = {"env_vars": {"PYTHONPATH": f"{REPO_ROOT}:{REPO_ROOT / 'tests'}"}}
ENGINE = {"max_model_len": 64, "num_gpu_blocks_override": 128, "max_num_seqs": 64, "block_size": 16}
GREEDY = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
REPLICA = "EngineStageUDF"
NUM_ROWS = 48


def prompt_of(i: int) -> str:
    return f"request {i} says " + "la " * (i % 5)


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(address="local", num_cpus=8, include_dashboard=False, runtime_env=RUNTIME_ENV)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(llama_path: Path) -> dict[int, list[int]]:
    llm = LLM(model=str(llama_path), distributed_executor_backend="uni", **ENGINE)
    try:
        outputs = llm.generate([prompt_of(i) for i in range(NUM_ROWS)], SamplingParams(**GREEDY), use_tqdm=False)
    finally:
        llm.shutdown()
    return {i: output.outputs[0].token_ids for i, output in enumerate(outputs)}


def to_request(row: dict[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "prompt": prompt_of(row["id"]), "sampling_params": GREEDY}


def processor_config(llama_path: Path, **fields: Any) -> EngineProcessorConfig:
    return EngineProcessorConfig(model_source=str(llama_path), engine_kwargs=ENGINE,
                                 placement_group_config={"bundles": [{"CPU": 0.5}]}, **fields)


def replicas() -> list[dict[str, Any]]:
    return [actor for actor in actors().values() if REPLICA in actor["ActorClassName"]]


@pytest.mark.slow  # two replicas start, and one of them again
def test_replica_killed_mid_run_every_row_exactly_once(local_ray: None, llama_path: Path,
                                                       reference: dict[int, list[int]]) -> None:
    """Once the first rows are out (both replicas busy with the batches queued behind them), one replica's process is
    SIGKILLed, as the OOM killer or a lost node would end it."""
    config = processor_config(llama_path, concurrency=2, batch_size=8, max_concurrent_batches=2)
    rows = []
    killed = None
    for row in build_processor(config, preprocess=to_request)(ray.data.range(NUM_ROWS)).iter_rows():
        rows.append(row)
        if killed is None:
            killed = next(actor for actor in replicas() if actor["State"] == "ALIVE")
            os.kill(killed["Pid"], signal.SIGKILL)
    assert killed is not None and len(rows) == NUM_ROWS
    assert sorted(row["id"] for row in rows) == list(range(NUM_ROWS))  # each row exactly once
    assert {row["id"]: list(row["generated_tokens"]) for row in rows} == reference
    # At least our kill; Ray's memory monitor may kill (and restart) replicas too on a crowded machine.
    assert [actor["NumRestarts"] >= 1 for actor in replicas() if actor["ActorID"] == killed["ActorID"]] == [True]


def bad_rows(row: dict[str, Any]) -> dict[str, Any]:
    request = to_request(row)
    if row["id"] == 3:
        request["sampling_params"] = GREEDY | {"max_tokenz": 4}
    if row["id"] == 5:
        request["prompt"] = "la " * 100  # beyond max_model_len 64
    return request


def one_bad_row(row: dict[str, Any]) -> dict[str, Any]:
    return bad_rows(row) if row["id"] == 3 else to_request(row)


def test_bad_rows_are_recorded_with_should_continue_on_error(local_ray: None, llama_path: Path,
                                                             reference: dict[int, list[int]]) -> None:
    config = processor_config(llama_path, batch_size=4, should_continue_on_error=True)
    processor = build_processor(config, preprocess=bad_rows,
                                postprocess=lambda row: {"id": row["id"], "tokens": row["generated_tokens"]})
    rows = {row["id"]: row for row in processor(ray.data.range(12)).take_all()}
    assert sorted(rows) == list(range(12))
    assert "unknown field(s) ['max_tokenz']" in rows[3]["__inference_error__"]
    assert "max_model_len" in rows[5]["__inference_error__"]
    good = [i for i in rows if i not in (3, 5)]
    assert {i: list(rows[i]["tokens"]) for i in good} == {i: reference[i] for i in good}
    assert {rows[i]["__inference_error__"] for i in good} == {""}


def test_a_bad_row_fails_the_job_naming_it(local_ray: None, llama_path: Path) -> None:
    processor = build_processor(processor_config(llama_path, batch_size=4), preprocess=one_bad_row)
    with pytest.raises(Exception, match=r"row id=3: sampling_params: unknown field\(s\) \['max_tokenz'\]"):
        processor(ray.data.range(8)).take_all()
