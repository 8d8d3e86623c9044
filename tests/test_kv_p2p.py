"""RayKVConnector over kv_transport="p2p": the prefill worker sends a prompt's KV to the decode worker on a process
group of their own (gloo here), not through Ray's object store. The decode engine gives the colocated engine's tokens,
greedy and seeded, for prompts ending mid-block, with prefix-cache hits on the decode side and from a producer in
another process; a transfer the producer no longer holds, a producer whose channel is shut or whose process died, and
a pair whose group broke are recomputed, with every block of both engines back in its pool, and the next transfer
pairs again. Nothing goes into the object store.

Both engines run through the offline API (LLM.generate): the prefill's generate returns as its requests finish, its
worker holding their blocks for the decode worker to pull, and frees them at its next step (finish here)."""
from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from raylm.cluster import LLM, RequestOutput, SamplingParams
from raylm.cluster.serve.serve_pd import pd_engine_config
from raylm.configs.kv_transfer import KVTransferConfig
from raylm.runner.kv_transfer.kv_store import kv_store_name
from tests.test_kv_connector import (
    ENGINE,
    GREEDY,
    PREFILL,
    SEEDED,
    assert_pool_empty,
    check_decode_side_prefix_hit,
    scheduler_of,
    token_prompts,
    tokens,
)

P2P = dict(kv_connector="RayKVConnector", kv_transport="p2p", kv_transfer_timeout_s=3.0)


def prefill_held(prefill: LLM, prompts: list[Any]) -> list[dict[str, Any]]:
    """Each prompt's kv_transfer_params from the prefill's LLM.generate, which returns as soon as the prefills finish
    (their blocks still held for a consumer), not after kv_transfer_timeout_s."""
    started = time.monotonic()
    transfers = [output.kv_transfer_params for output in prefill.generate(prompts, PREFILL, use_tqdm=False)]
    assert time.monotonic() - started < P2P["kv_transfer_timeout_s"], "generate waited for a consumer"
    assert all(params is not None and "remote_port" in params and "remote_store" not in params
               for params in transfers)
    return transfers  # type: ignore[return-value]


def wait_until_gone(pid: int) -> None:
    """ray.kill returns, and the actor reads as dead, before its process (serving its channel) has exited."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"the killed worker's process {pid} is still running")


def finish(prefill: LLM) -> None:
    """Free the blocks the prefill engine held for decode workers (sent, or timed out): the engine does not step for
    them, so its next request's steps (a one-token prompt here, as a caller's next generate) free them."""
    tracker = scheduler_of(prefill).kv_transfers
    assert tracker is not None
    deadline = time.monotonic() + 30
    while tracker.sending:
        assert time.monotonic() < deadline, f"held blocks of {list(tracker.sending)} were never freed"
        prefill.generate([{"prompt_token_ids": [7]}], replace(GREEDY, max_tokens=1), use_tqdm=False)


def p2p_prefill_then_decode(prefill: LLM, decode: LLM, prompts: list[Any], params: SamplingParams,
                            edit: Any = None) -> list[RequestOutput]:
    transfers = prefill_held(prefill, prompts)
    if edit is not None:
        transfers = [edit(transfer) for transfer in transfers]
    per_prompt = [replace(params, extra_args={"kv_transfer_params": transfer}) for transfer in transfers]
    outputs = decode.generate(prompts, per_prompt, use_tqdm=False)
    finish(prefill)
    return outputs


def worker_connector(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.executor.worker.model_runner.kv_connector


@pytest.fixture(scope="module")
def engines(ray_cluster: Any, llama_path: Path) -> Iterator[dict[str, LLM]]:
    model = str(llama_path)
    built = {"colocated": LLM(model=model, **ENGINE),
             "prefill": LLM(model=model, kv_role="kv_producer", **P2P, **ENGINE),
             "decode": LLM(model=model, kv_role="kv_consumer", **P2P, **ENGINE)}
    yield built
    for llm in built.values():
        llm.shutdown()


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_p2p_equals_colocated(engines: dict[str, LLM], params: SamplingParams) -> None:
    prompts = token_prompts((2, 5, 16, 17, 31, 33, 64, 100), seed=30 + params.greedy)
    expected = tokens(engines["colocated"].generate(prompts, params, use_tqdm=False))
    tracker = scheduler_of(engines["decode"]).kv_transfers
    assert tracker is not None
    received, failed = tracker.num_received_tokens, tracker.num_failed_loads
    outputs = p2p_prefill_then_decode(engines["prefill"], engines["decode"], prompts, params)
    assert tokens(outputs) == expected
    assert tracker.num_received_tokens - received == sum(len(p["prompt_token_ids"]) - 1 for p in prompts)
    assert tracker.num_failed_loads == failed
    assert all(output.kv_transfer_params is None for output in outputs)  # nothing to report: every load arrived
    assert_pool_empty(engines["prefill"], engines["decode"])
    # Nothing went through the object store: no engine here made its node's KVStore.
    names = {actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)}
    assert kv_store_name(ray.get_runtime_context().get_node_id()) not in names


def test_p2p_decode_side_prefix_hit_takes_only_the_rest(engines: dict[str, LLM]) -> None:
    check_decode_side_prefix_hit(engines, p2p_prefill_then_decode, seed=31)


def test_p2p_transfer_not_held_is_recomputed(engines: dict[str, LLM]) -> None:
    """The decode engine asks for a key the producer does not hold: told at once, it recomputes; the producer's own
    offer, never taken, frees its blocks after kv_transfer_timeout_s."""
    prefill, decode = engines["prefill"], engines["decode"]
    prompts = token_prompts((20, 45), seed=33)
    tracker = scheduler_of(decode).kv_transfers
    assert tracker is not None
    failed = tracker.num_failed_loads

    def missing(params: dict[str, Any]) -> dict[str, Any]:
        return params | {"remote_transfer_key": params["remote_transfer_key"] + "-gone"}

    outputs = p2p_prefill_then_decode(prefill, decode, prompts, GREEDY, missing)
    assert tokens(outputs) == tokens(engines["colocated"].generate(prompts, GREEDY, use_tqdm=False))
    assert tracker.num_failed_loads - failed == 2
    assert all("did not arrive" in output.kv_transfer_params["kv_load_error"] for output in outputs)  # type: ignore
    assert_pool_empty(prefill, decode)


def test_p2p_broken_pair_is_recomputed_then_paired_again(engines: dict[str, LLM]) -> None:
    prefill, decode = engines["prefill"], engines["decode"]
    consumer = worker_connector(decode)._consumer
    [pair] = consumer._pairs.values()
    with pytest.raises(RuntimeError):  # a receive that times out closes gloo's pair: the group is broken
        pair.group.recv([torch.empty(1)], 0, 0).wait(timedelta(seconds=0.05))
    tracker = scheduler_of(decode).kv_transfers
    assert tracker is not None
    broken, again = ([prompt] for prompt in token_prompts((37, 37), seed=34))  # two: decode caches the first
    failed, received = tracker.num_failed_loads, tracker.num_received_tokens
    for prompts, counts in ((broken, (1, 0)), (again, (1, 36))):
        expected = tokens(engines["colocated"].generate(prompts, GREEDY, use_tqdm=False))
        assert tokens(p2p_prefill_then_decode(prefill, decode, prompts, GREEDY)) == expected
        assert (tracker.num_failed_loads - failed, tracker.num_received_tokens - received) == counts
    assert consumer._pairs and next(iter(consumer._pairs.values())) is not pair
    assert_pool_empty(prefill, decode)


def test_p2p_gone_producer_is_recomputed(engines: dict[str, LLM], llama_path: Path) -> None:
    """A producer whose channel shut after its prefill: the decode worker's pairing times out and it recomputes; the
    producer's held blocks time out too."""
    producer = LLM(model=str(llama_path), kv_role="kv_producer", **P2P, **ENGINE)
    try:
        decode = engines["decode"]
        prompts = token_prompts((26,), seed=35)
        transfers = prefill_held(producer, prompts)
        worker_connector(producer).shutdown()
        tracker = scheduler_of(decode).kv_transfers
        assert tracker is not None
        failed = tracker.num_failed_loads
        with_transfer = [replace(GREEDY, extra_args={"kv_transfer_params": transfer}) for transfer in transfers]
        outputs = decode.generate(prompts, with_transfer, use_tqdm=False)
        assert tokens(outputs) == tokens(engines["colocated"].generate(prompts, GREEDY, use_tqdm=False))
        assert tracker.num_failed_loads - failed == 1
        finish(producer)
        assert_pool_empty(producer, decode)
    finally:
        producer.shutdown()


def test_kv_transport_is_checked_and_reaches_serve_pd() -> None:
    for wrong in ({}, {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}):
        with pytest.raises(ValueError, match="kv_transport"):
            KVTransferConfig(kv_transport="p2p", **wrong)
    args = {"prefill_config": {"config": "raylm/configs/tiny.yaml", "kv_transport": "p2p"}}
    assert pd_engine_config(args, "prefill_config").kv_transfer_config.kv_transport == "p2p"


def test_p2p_dead_producer_is_recomputed(engines: dict[str, LLM], llama_path: Path) -> None:
    """A prefill worker in a process of its own (a Ray actor) sends across processes; once killed after a prefill, the
    decode worker cannot reach it and recomputes, leaving its pool whole."""
    producer = LLM(model=str(llama_path), kv_role="kv_producer", distributed_executor_backend="ray", **P2P, **ENGINE)
    try:
        decode = engines["decode"]
        tracker = scheduler_of(decode).kv_transfers
        assert tracker is not None
        sent, prompts = ([prompt] for prompt in token_prompts((40, 29), seed=37))
        failed, received = tracker.num_failed_loads, tracker.num_received_tokens
        expected = tokens(engines["colocated"].generate(sent, GREEDY, use_tqdm=False))
        assert tokens(p2p_prefill_then_decode(producer, decode, sent, GREEDY)) == expected
        assert (tracker.num_failed_loads - failed, tracker.num_received_tokens - received) == (0, 39)
        assert_pool_empty(producer)
        transfers = prefill_held(producer, prompts)
        [worker] = producer.llm_engine.engine_core.executor.workers
        [pid] = producer.collective_rpc(lambda _: os.getpid())
        ray.kill(worker)
        wait_until_gone(pid)
        with_transfer = [replace(GREEDY, extra_args={"kv_transfer_params": transfer}) for transfer in transfers]
        outputs = decode.generate(prompts, with_transfer, use_tqdm=False)
        assert tokens(outputs) == tokens(engines["colocated"].generate(prompts, GREEDY, use_tqdm=False))
        assert tracker.num_failed_loads - failed == 1
        assert_pool_empty(decode)
    finally:
        producer.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices: NCCL pairs no two ranks on one")
def test_p2p_on_cuda_equals_colocated(ray_cluster: Any, llama_path: Path) -> None:
    """The same hand-over over NCCL, device to device: each engine's worker a Ray actor on a GPU of its own."""
    cuda = dict(ENGINE, device="cuda", dtype="float32", distributed_executor_backend="ray")
    model = str(llama_path)
    colocated = LLM(model=model, **cuda)
    prefill = LLM(model=model, kv_role="kv_producer", **P2P, **cuda)
    decode = LLM(model=model, kv_role="kv_consumer", **P2P, **cuda)
    try:
        prompts = token_prompts((5, 17, 64, 100), seed=36)
        tracker = scheduler_of(decode).kv_transfers
        assert tracker is not None
        for params in (GREEDY, SEEDED):
            expected = tokens(colocated.generate(prompts, params, use_tqdm=False))
            assert tokens(p2p_prefill_then_decode(prefill, decode, prompts, params)) == expected
        assert tracker.num_failed_loads == 0
        assert_pool_empty(prefill, decode)
    finally:
        for llm in (colocated, prefill, decode):
            llm.shutdown()
