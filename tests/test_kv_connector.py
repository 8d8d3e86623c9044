"""KV connectors on a local Ray: disaggregated prefill (RayKVConnector: a prefill engine's KV taken by a decode engine)
gives the colocated engine's tokens, greedy and seeded, for prompts ending mid-block and with prefix-cache hits on the
decode side; offloaded-then-loaded KV (OffloadingConnector) gives the tokens of recompute; a transfer or load that
fails or comes in part is recomputed, leaving every block of both engines back in its pool; a transfer that finds the
decode pool full waits for room instead of being dropped; the connector calls come in vLLM's documented order. The
engines here run a connector that also writes its calls down (kv_connector_recorder)."""
from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
import torch

from raylm.cluster import LLM, RequestOutput, SamplingParams
from raylm.cluster.core.block_pool import hash_block_tokens
from raylm.cluster.core.scheduler import Scheduler
from raylm.common.lora_request import LoRARequest
from raylm.runner.kv_transfer.kv_store import node_kv_store
from tests import kv_connector_recorder
from tests.lora_utils import make_adapter

BLOCK = 16
ENGINE = dict(max_model_len=256, block_size=BLOCK, num_gpu_blocks_override=48, max_num_seqs=8)
RECORDING = dict(kv_connector="RecordingRayKVConnector", kv_connector_module_path="tests.kv_connector_recorder")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=8, ignore_eos=True)
PREFILL = SamplingParams(temperature=0.0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})


def token_prompts(lengths: tuple[int, ...], seed: int = 0) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(5, 512) for _ in range(n)]} for n in lengths]


def scheduler_of(llm: LLM) -> Scheduler:
    return llm.llm_engine.engine_core.scheduler


def assert_pool_empty(*llms: LLM) -> None:
    for llm in llms:
        manager = scheduler_of(llm).kv_cache_manager
        assert manager.num_free_blocks == manager.num_blocks
        assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)
        assert not scheduler_of(llm).has_unfinished_requests()


def tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


def prefill_then_decode(prefill: LLM, decode: LLM, prompts: list[Any], params: SamplingParams,
                        edit: Any = None) -> list[RequestOutput]:
    """The prompts through the prefill engine (one token, KV kept for a decode engine), then the decode engine with the
    kv_transfer_params each prefill returned (changed by `edit` if given)."""
    prefilled = prefill.generate(prompts, PREFILL, use_tqdm=False)
    transfer = [output.kv_transfer_params for output in prefilled]
    assert all(params is not None and params["do_remote_prefill"] for params in transfer)
    if edit is not None:
        transfer = [edit(params) for params in transfer]
    per_prompt = [replace(params, extra_args={"kv_transfer_params": p}) for p in transfer]
    return decode.generate(prompts, per_prompt, use_tqdm=False)


@pytest.fixture(scope="module")
def engines(ray_cluster: Any, llama_path: Path) -> Iterator[dict[str, LLM]]:
    model = str(llama_path)
    built = {"colocated": LLM(model=model, **ENGINE),
             "prefill": LLM(model=model, kv_role="kv_producer", **RECORDING, **ENGINE),
             "decode": LLM(model=model, kv_role="kv_consumer", kv_transfer_timeout_s=2.0, **RECORDING, **ENGINE)}
    yield built
    for llm in built.values():
        llm.shutdown()


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_disaggregated_equals_colocated(engines: dict[str, LLM], params: SamplingParams) -> None:
    # Mid-block and whole-block ends; prompts of their own, so that the decode engine has none of them cached.
    prompts = token_prompts((2, 5, 16, 17, 31, 33, 64, 100), seed=10 + params.greedy)
    expected = tokens(engines["colocated"].generate(prompts, params, use_tqdm=False))
    tracker = scheduler_of(engines["decode"]).kv_transfers
    assert tracker is not None
    received_before = tracker.num_received_tokens
    outputs = prefill_then_decode(engines["prefill"], engines["decode"], prompts, params)
    assert tokens(outputs) == expected
    # Every prompt token but the last came from the prefill engine; the last gave the first token here.
    assert tracker.num_received_tokens - received_before == sum(len(p["prompt_token_ids"]) - 1 for p in prompts)
    assert tracker.num_failed_loads == 0
    assert_pool_empty(engines["prefill"], engines["decode"])


def check_decode_side_prefix_hit(engines: dict[str, LLM], transfer: Any, seed: int) -> None:
    """Prompts sharing three blocks the decode engine already caches: `transfer` (prefill, decode, prompts, params ->
    outputs) moves only the blocks past them, and the tokens are the colocated engine's."""
    decode = engines["decode"]
    [first] = token_prompts((60,), seed=seed)
    shared = first["prompt_token_ids"][:50]  # three whole blocks and two tokens
    prompts = [{"prompt_token_ids": shared + tail["prompt_token_ids"]}
               for tail in token_prompts((23, 9), seed=seed + 1)]
    decode.generate([first], GREEDY, use_tqdm=False)  # decode's own prefix cache now holds its three blocks
    scheduler = scheduler_of(decode)
    assert scheduler.kv_transfers is not None
    hits, received = scheduler.prefix_cache_hits, scheduler.kv_transfers.num_received_tokens
    outputs = transfer(engines["prefill"], decode, prompts, GREEDY)
    assert tokens(outputs) == tokens(engines["colocated"].generate(prompts, GREEDY, use_tqdm=False))
    assert scheduler.prefix_cache_hits - hits == 2 * 48
    assert scheduler.kv_transfers.num_received_tokens - received == sum(
        len(p["prompt_token_ids"]) - 1 - 48 for p in prompts)
    assert_pool_empty(engines["prefill"], decode)


def test_decode_side_prefix_hit_loads_only_the_rest(engines: dict[str, LLM]) -> None:
    check_decode_side_prefix_hit(engines, prefill_then_decode, seed=1)


def test_connector_calls_come_in_vllm_order(engines: dict[str, LLM]) -> None:
    prompts = token_prompts((40,), seed=3)
    kv_connector_recorder.CALLS.clear()
    prefill_then_decode(engines["prefill"], engines["decode"], prompts, replace(GREEDY, max_tokens=3))
    short = {"get_num_new_matched_tokens": "match", "update_state_after_alloc": "alloc",
             "build_connector_meta": "build", "bind_connector_metadata": "bind", "start_load_kv": "start",
             "wait_for_layer_load": "wl", "save_kv_layer": "sl", "wait_for_save": "ws", "get_finished": "gf",
             "get_block_ids_with_load_errors": "ge", "clear_connector_metadata": "clear",
             "update_connector_output": "upd", "request_finished": "fin"}

    def log(role: str) -> str:
        return " ".join(short[name] for who, name in kv_connector_recorder.CALLS if who == role) + " "

    no_forward = "build bind start ws gf ge clear upd "
    forward = "build bind start (wl sl ){2}ws gf ge clear "  # two layers: wait for each one's load, save it
    # The prefill: admitted, one forward that completes the prompt and samples its token (the request finishes with
    # its blocks held), then steps without a forward until the worker reports them sent.
    assert re.fullmatch(f"match alloc {forward}fin upd ({no_forward})*", log("kv_producer")), log("kv_producer")
    # The decode: admitted to wait for its KV; steps without a forward until received; admitted again to compute the
    # last prompt token; three forwards, the last finishing it.
    assert re.fullmatch(f"match alloc ({no_forward})+alloc ({forward}upd ){{2}}{forward}fin upd ",
                        log("kv_consumer")), log("kv_consumer")


def test_missing_or_partial_transfer_is_recomputed(engines: dict[str, LLM]) -> None:
    prefill, decode = engines["prefill"], engines["decode"]
    prompts = token_prompts((20, 45), seed=4)
    expected = tokens(engines["colocated"].generate(prompts, GREEDY, use_tqdm=False))
    tracker = scheduler_of(decode).kv_transfers
    assert tracker is not None
    failed = tracker.num_failed_loads

    def missing(params: dict[str, Any]) -> dict[str, Any]:  # a transfer that never comes (decode waits 2 s)
        return params | {"remote_transfer_key": params["remote_transfer_key"] + "-gone"}

    outputs = prefill_then_decode(prefill, decode, prompts, GREEDY, missing)
    assert tokens(outputs) == expected
    assert tracker.num_failed_loads - failed == 2
    # Said in each request's output, not only in the log.
    assert all("did not arrive" in output.kv_transfer_params["kv_load_error"] for output in outputs)  # type: ignore

    def partial(params: dict[str, Any]) -> dict[str, Any]:  # the prefill's transfer, less its second layer
        store = ray.get_actor(params["remote_store"], namespace="raylm")
        layers, num_layers = ray.get(store.take_transfer.remote(params["remote_transfer_key"], 5.0))
        first = dict(list(layers.items())[:1])
        ray.get(store.offer_transfer.remote(params["remote_transfer_key"], first, num_layers, 30.0))
        return params

    assert tokens(prefill_then_decode(prefill, decode, prompts, GREEDY, partial)) == expected
    assert tracker.num_failed_loads - failed == 4
    assert_pool_empty(prefill, decode)


def test_transfer_waits_for_room_on_a_full_decode_pool(engines: dict[str, LLM]) -> None:
    """Three running prompts hold 45 of the decode engine's 48 blocks when a transferred prompt needing 4 arrives: it
    is admitted to receive its KV once they finish, rather than dropping the transfer and recomputing."""
    prefill, decode = engines["prefill"], engines["decode"]
    busy = token_prompts((232, 232, 232), seed=8)
    [prompt] = token_prompts((60,), seed=9)
    expected = tokens(engines["colocated"].generate([prompt], GREEDY, use_tqdm=False))
    [prefilled] = prefill.generate([prompt], PREFILL, use_tqdm=False)
    tracker = scheduler_of(decode).kv_transfers
    assert tracker is not None
    received, failed = tracker.num_received_tokens, tracker.num_failed_loads
    with_transfer = replace(GREEDY, extra_args={"kv_transfer_params": prefilled.kv_transfer_params})
    outputs = decode.generate(busy + [prompt], [GREEDY] * 3 + [with_transfer], use_tqdm=False)
    assert tokens(outputs[3:]) == expected
    assert (tracker.num_received_tokens - received, tracker.num_failed_loads - failed) == (59, 0)
    assert_pool_empty(prefill, decode)


def test_offloaded_blocks_load_back_with_recomputes_tokens(engines: dict[str, LLM], llama_path: Path) -> None:
    offload = LLM(model=str(llama_path), kv_offloading_size=0.05, **(ENGINE | {"num_gpu_blocks_override": 24}))
    try:
        scheduler = scheduler_of(offload)
        tracker = scheduler.kv_transfers
        assert tracker is not None
        returning, *others = token_prompts((100, 180, 180, 180), seed=5)
        expected = tokens(engines["colocated"].generate([returning], GREEDY, use_tqdm=False))
        assert tokens(offload.generate([returning], GREEDY, use_tqdm=False)) == expected
        for other in others:  # 12 blocks each of the 24: the returning prompt's are evicted
            offload.generate([other], GREEDY, use_tqdm=False)
        hits = scheduler.prefix_cache_hits
        [again] = offload.generate([returning], GREEDY, use_tqdm=False)
        assert again.outputs[0].token_ids == expected[0]
        assert scheduler.prefix_cache_hits == hits  # nothing left on the device ...
        assert again.num_cached_tokens == 96  # ... its six whole blocks came back from the host store
        assert tracker.num_failed_loads == 0
        assert_pool_empty(offload)
    finally:
        offload.shutdown()


@pytest.mark.parametrize("other", [{"quantization": "int8"}, {"dtype": "bfloat16"}], ids=["int8", "bfloat16"])
def test_pair_of_another_kv_identity_is_refused(engines: dict[str, LLM], llama_path: Path,
                                                other: dict[str, str]) -> None:
    """A decode engine of the same checkpoint and shapes whose KV would differ (quantized weights, another dtype)
    refuses the prefill's KV, naming the field, recomputes, and says so in the output."""
    [(name, value)] = other.items()
    # float32 unless the case changes the dtype: int8 weights alone would compute bfloat16 on a bfloat16 CPU
    decode = LLM(model=str(llama_path), kv_connector="RayKVConnector", kv_role="kv_consumer", **ENGINE,
                 **{"dtype": "float32", **other})
    try:
        prompts = token_prompts((40,), seed=11)
        expected = tokens(decode.generate(prompts, GREEDY, use_tqdm=False))
        tracker = scheduler_of(decode).kv_transfers
        assert tracker is not None
        [output] = prefill_then_decode(engines["prefill"], decode, prompts, GREEDY)
        assert tokens([output]) == expected
        assert tracker.num_received_tokens == 0
        assert output.kv_transfer_params is not None
        here = {"quantization": "'none' there, 'int8' here", "dtype": "'float32' there, 'bfloat16' here"}[name]
        assert f"the prefill's KV was refused: {name} {here}" == output.kv_transfer_params["kv_load_error"]
        assert_pool_empty(engines["prefill"], decode)
    finally:
        decode.shutdown()


def test_pair_shares_kv_only_under_the_same_lora_adapter(llama_path: Path, ray_cluster: Any,
                                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    """A prompt prefilled under adapter A: a decode under A takes its KV; one under B refuses it, naming the adapters,
    and computes B's tokens."""
    root = tmp_path_factory.mktemp("pd_adapters")
    lora_a, lora_b = (LoRARequest(name, i + 1, str(make_adapter(llama_path, root / name, seed=40 + i, r=4)))
                      for i, name in enumerate("ab"))
    settings = dict(model=str(llama_path), kv_connector="RayKVConnector", enable_lora=True, max_loras=2,
                    max_lora_rank=8, **ENGINE)
    prefill, decode = LLM(kv_role="kv_producer", **settings), LLM(kv_role="kv_consumer", **settings)
    try:
        tracker = scheduler_of(decode).kv_transfers
        assert tracker is not None
        for lora, shared in ((lora_a, True), (lora_b, False)):
            prompts = token_prompts((40,), seed=13 + shared)
            expected = tokens(prefill.generate(prompts, GREEDY, lora_request=lora, use_tqdm=False))
            [done] = prefill.generate(prompts, PREFILL, lora_request=lora_a, use_tqdm=False)
            received = tracker.num_received_tokens
            with_transfer = replace(GREEDY, extra_args={"kv_transfer_params": done.kv_transfer_params})
            [out] = decode.generate(prompts, with_transfer, lora_request=lora, use_tqdm=False)
            assert tokens([out]) == expected
            assert tracker.num_received_tokens - received == (39 if shared else 0)
            if not shared:
                assert out.kv_transfer_params is not None and out.kv_transfer_params["kv_load_error"] == (
                    f"the prefill's KV was refused: it was computed under LoRA adapter 'a@{lora_a.lora_path}', "
                    f"here 'b@{lora_b.lora_path}'")
        assert_pool_empty(prefill, decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_offloaded_blocks_are_shared_only_by_the_same_kv_identity(llama_path: Path, ray_cluster: Any) -> None:
    """Engines of one checkpoint on a node share its store: one of the same identity loads the evicted blocks of
    another; one quantized int8 finds none of them."""
    settings = dict(model=str(llama_path), kv_offloading_size=0.05, **(ENGINE | {"num_gpu_blocks_override": 24}))
    returning, *others = token_prompts((100, 180, 180, 180), seed=12)
    writer = LLM(**settings)
    try:
        for prompt in [returning, *others]:  # 12 blocks each of the 24: the returning prompt's go to the store
            writer.generate([prompt], GREEDY, use_tqdm=False)
        for other, cached in (({"quantization": "int8"}, 0), ({}, 96)):
            reader = LLM(**settings, **other)
            try:
                [out] = reader.generate([returning], GREEDY, use_tqdm=False)
                assert out.num_cached_tokens == cached, other  # a new engine: all it holds came from the store
            finally:
                reader.shutdown()
    finally:
        writer.shutdown()


@ray.remote(num_cpus=0)
class _ShortLivedWriter:
    """Puts blocks into the node's store as an engine does, then dies: the objects it owned are lost with it."""

    def offload(self, namespace: str, hashes: list[bytes], blocks: np.ndarray, block_bytes: int) -> None:
        ray.get(node_kv_store().put_blocks.remote(namespace, hashes, [ray.put(blocks)], block_bytes))



def test_lost_offloaded_blocks_are_recomputed(engines: dict[str, LLM], llama_path: Path) -> None:
    offload = LLM(model=str(llama_path), kv_offloading_size=0.05, **ENGINE)
    try:
        [prompt] = token_prompts((70,), seed=6)
        token_ids = prompt["prompt_token_ids"]
        hashes: list[bytes] = []
        for i in range(len(token_ids) // BLOCK):
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, token_ids[i * BLOCK:(i + 1) * BLOCK]))
        connector = offload.llm_engine.engine_core.kv_connector
        runner_layers = offload.llm_engine.engine_core.executor.worker.model_runner.kv_caches
        garbage = np.full((len(hashes), 2, len(runner_layers), *runner_layers[0].shape[2:]), 7, dtype=np.int32)
        writer = _ShortLivedWriter.remote()
        ray.get(writer.offload.remote(connector.namespace, hashes, garbage, 1))
        ray.kill(writer)
        [[ref], _] = ray.get(node_kv_store().get_blocks.remote(connector.namespace, hashes[:1]))[0]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until Ray itself has noticed that their owner is gone
            try:
                ray.get(ref, timeout=10)
            except ray.exceptions.OwnerDiedError:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the writer's objects outlived it")
        tracker = scheduler_of(offload).kv_transfers
        assert tracker is not None
        outputs = offload.generate([prompt], GREEDY, use_tqdm=False)
        assert tokens(outputs) == tokens(engines["colocated"].generate([prompt], GREEDY, use_tqdm=False))
        assert tracker.num_failed_loads == 1
        assert_pool_empty(offload)
    finally:
        offload.shutdown()


def test_transfer_whose_store_is_gone_is_recomputed(engines: dict[str, LLM]) -> None:
    """The prefill node's store dies before the prefill saves: the prefill still frees its blocks, the decode engine
    recomputes. (Last in the module: the engines here keep the dead store's handle.)"""
    prefill, decode = engines["prefill"], engines["decode"]
    ray.kill(node_kv_store())
    prompts = token_prompts((30,), seed=7)
    expected = tokens(engines["colocated"].generate(prompts, GREEDY, use_tqdm=False))
    assert tokens(prefill_then_decode(prefill, decode, prompts, GREEDY)) == expected
    assert_pool_empty(prefill, decode)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_disaggregated_on_cuda_equals_colocated(ray_cluster: Any, llama_path: Path) -> None:
    """The same hand-over from device caches: blocks copied device to host into the object store, and back."""
    cuda = dict(ENGINE, device="cuda", dtype="float32")
    model = str(llama_path)
    colocated = LLM(model=model, **cuda)
    prefill = LLM(model=model, kv_connector="RayKVConnector", kv_role="kv_producer", **cuda)
    decode = LLM(model=model, kv_connector="RayKVConnector", kv_role="kv_consumer", **cuda)
    try:
        prompts = token_prompts((5, 17, 64, 100), seed=20)
        for params in (GREEDY, SEEDED):
            expected = tokens(colocated.generate(prompts, params, use_tqdm=False))
            assert tokens(prefill_then_decode(prefill, decode, prompts, params)) == expected
        assert_pool_empty(prefill, decode)
    finally:
        for llm in (colocated, prefill, decode):
            llm.shutdown()
