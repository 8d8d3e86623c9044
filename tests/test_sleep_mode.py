"""Sleep mode (LLM.sleep / wake_up): memory freed and restored, identical output after waking, requests refused while
asleep, through the uni and Ray executors and the dev HTTP routes."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.engine.outputs import EngineSleepingError
from raylm.configs import envs
from raylm.runner.sleep_mode import offload, restore, storage_bytes, unique_storages
from tests.http_server import served_engine

PROMPTS = ["The quick brown fox", "Sleep mode frees"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _device_bytes(llm: LLM) -> dict[str, int]:
    return llm.collective_rpc("device_bytes")[0]


def test_offload_and_restore_keep_views() -> None:
    base = torch.arange(12, dtype=torch.float32)
    view = base.view(3, 4)[1:]
    storages = unique_storages([base, view])
    assert len(storages) == 1
    slept = offload(storages, keep=True)
    assert storage_bytes([base, view]) == 0
    restore(slept)
    assert torch.equal(base, torch.arange(12, dtype=torch.float32)) and view[0, 0].item() == 4.0


@pytest.fixture(scope="module")
def llm(llama_path: Path) -> Iterator[LLM]:
    engine = LLM(model=str(llama_path), max_model_len=128, block_size=16, num_gpu_blocks_override=64,
                 distributed_executor_backend="uni", enable_prefix_caching=True)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_round_trip(llm: LLM, level: int) -> None:
    expected = _tokens(llm)
    awake = _device_bytes(llm)
    assert awake["weights"] > 0 and awake["kv_cache"] > 0
    llm.sleep(level)
    assert llm.is_sleeping()
    assert _device_bytes(llm) == {"weights": 0, "kv_cache": 0}
    with pytest.raises(EngineSleepingError, match="sleeping"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up()
    assert not llm.is_sleeping() and _device_bytes(llm) == awake
    assert _tokens(llm) == expected


def test_wake_up_by_tags(llm: LLM) -> None:
    expected = _tokens(llm)
    llm.sleep(1)
    llm.wake_up(["weights"])
    assert llm.is_sleeping() and _device_bytes(llm)["kv_cache"] == 0 and _device_bytes(llm)["weights"] > 0
    llm.wake_up(["kv_cache"])
    assert not llm.is_sleeping()
    assert _tokens(llm) == expected
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up(["optimizer"])
    with pytest.raises(ValueError, match="level"):
        llm.sleep(3)


def test_sleep_refused_while_requests_run(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request("busy", PROMPTS[0], GREEDY)
    with pytest.raises(RuntimeError, match="unfinished"):
        llm.sleep(1)
    engine.abort_request(["busy"])
    assert not llm.is_sleeping()


def test_sleep_tp2_on_ray(llama_path: Path, ray_cluster: None) -> None:
    llm = LLM(model=str(llama_path), tensor_parallel_size=2, max_model_len=128, block_size=16,
              num_gpu_blocks_override=32)
    try:
        expected = _tokens(llm)
        llm.sleep(2)
        assert all(b == {"weights": 0, "kv_cache": 0} for b in llm.collective_rpc("device_bytes"))
        llm.wake_up()
        assert _tokens(llm) == expected
    finally:
        llm.shutdown()


@pytest.mark.parametrize("dev_mode", ["1", "0"])
def test_dev_endpoints(llama_path: Path, monkeypatch: pytest.MonkeyPatch, dev_mode: str) -> None:
    monkeypatch.setenv(envs.RAYLM_SERVER_DEV_MODE, dev_mode)
    with served_engine(llama_path) as (server, engine):
        if dev_mode == "0":
            assert server.request("GET", "/is_sleeping")[0] == 404
            assert server.request("POST", "/sleep?level=1")[0] == 404
            return
        assert server.request("GET", "/is_sleeping") == (200, {"is_sleeping": False})
        assert server.request("POST", "/sleep?level=1") == (200, {"is_sleeping": True})
        body = {"model": engine.model_name, "prompt": "hi", "max_tokens": 2}
        status, error = server.request("POST", "/v1/completions", body)
        assert status == 400 and "sleeping" in error["error"]["message"]
        assert server.request("POST", "/wake_up?tags=weights") == (200, {"is_sleeping": True})
        assert server.request("POST", "/wake_up") == (200, {"is_sleeping": False})
        assert server.request("POST", "/sleep?level=5")[0] == 400
        assert server.request("POST", "/v1/completions", body)[0] == 200
