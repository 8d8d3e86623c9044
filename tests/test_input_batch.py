"""The persistent InputBatch and the packed inputs the ModelRunner prepares from it."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from raylm.cluster.engine.config_resolver import resolve_engine_config
from raylm.common.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from raylm.common.sampling_params import SamplingParams
from raylm.configs import make_engine_config
from raylm.configs.bundles import EngineBundles
from raylm.configs.cudagraph_plan import CUDAGraphPlan
from raylm.configs.engine_config import ResolvedConfig
from raylm.configs.kv_identity import KVIdentity
from raylm.configs.model_info import ModelInfo
from raylm.runner.input_batch import CachedRequestState, InputBatch
from raylm.runner.model_runner import ModelRunner
from raylm.runner.parallel_state import init_model_parallel


def state(req_id: str, num_tokens: int, blocks: list[int], computed: int = 0) -> CachedRequestState:
    return CachedRequestState(req_id, list(range(10, 10 + num_tokens)), [], SamplingParams(seed=1), blocks, computed)


def test_free_rows_are_reused_and_condensed() -> None:
    batch = InputBatch(max_num_reqs=4, max_model_len=32, max_blocks_per_req=8, vocab_size=100)
    for i in range(3):
        batch.add_request(state(f"r{i}", 3 + i, [i]))
    assert batch.req_id_to_index == {"r0": 0, "r1": 1, "r2": 2}

    batch.remove_request("r1")
    assert batch.add_request(state("r3", 4, [9])) == 1  # the freed row, not a new one
    assert batch.num_tokens[1] == 4 and batch.block_table.table[1, 0] == 9

    batch.remove_request("r0")
    batch.condense()  # the last row moves into the hole
    assert batch.req_id_to_index == {"r2": 0, "r3": 1}
    assert batch.num_tokens[0] == 5 and list(batch.token_ids_cpu[0, :5]) == [10, 11, 12, 13, 14]
    assert batch.block_table.table[0, 0] == 2 and batch.num_rows == 2


def make_runner(block_size: int = 4) -> ModelRunner:
    """A runner with no model: its InputBatch and InputBuffers, on a config resolved by hand."""
    config = make_engine_config(block_size=block_size, max_num_seqs=4, max_num_batched_tokens=64, device="cpu",
                                dtype="float32", max_model_len=64, attention_backend="torch")
    info = ModelInfo(path="unused", architecture="LlamaForCausalLM", vocab_size=100, num_hidden_layers=1,
                     max_position_embeddings=64, checkpoint_dtype="float32", eos_token_ids=(1,))
    resolution = ResolvedConfig(
        model_info=info, device="cpu", dtype="float32", quantization="none", attention_backend="torch",
        executor_backend="uni", cudagraph=CUDAGraphPlan("NONE", ()), dp_lockstep=False, uniform_decode_query_len=1,
        max_concurrent_batches=1, bundle_layout=EngineBundles({"CPU": 1.0}, ()), num_ray_bundles=2,
        routing_policy="load", structured_outputs_backends=(), kv_identity=KVIdentity("unused", "", "float32", "none"))
    config = dataclasses.replace(config, resolution=resolution)
    return ModelRunner(config, torch.device("cpu"))


def test_slot_mapping_hand_computed() -> None:
    runner = make_runner(block_size=4)
    params = SamplingParams(seed=3)
    step1 = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", list(range(20, 26)), [], params, [3, 7], 0),
                            NewRequestData("b", list(range(30, 35)), [], params, [2], 0)],
        scheduled_cached_reqs=CachedRequestData(), num_scheduled_tokens={"a": 6, "b": 3},
        total_num_scheduled_tokens=9, finished_req_ids=set())
    runner.states.update(step1, True)
    buffers = runner.buffers
    inputs = buffers.prepare(step1, runner.input_batch)
    assert inputs.num_tokens == 9 and not inputs.uniform_decode
    # a: positions 0..5 in blocks 3, 7 -> slots 12..15, 28, 29; b: a 3-token chunk of its 5 in block 2.
    assert buffers.slot_mapping.np[:9].tolist() == [12, 13, 14, 15, 28, 29, 8, 9, 10]
    assert buffers.positions.np[:9].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    assert buffers.input_ids.np[:9].tolist() == [20, 21, 22, 23, 24, 25, 30, 31, 32]
    assert buffers.query_start_loc.np[:3].tolist() == [0, 6, 9]
    assert buffers.seq_lens.np[:2].tolist() == [6, 3]
    assert inputs.sampling_rows.tolist() == [0]  # b is a partial prefill: it does not sample
    assert inputs.logits_indices.tolist() == [5]

    # Next step: b finishes its prompt (2 tokens, a new block 5), a decodes one token.
    runner.input_batch.append_token(0, 99)
    step2 = SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(req_ids=["a", "b"], new_block_ids=[[], [5]],
                                                num_computed_tokens=[6, 3], new_token_ids=[[], []]),
        num_scheduled_tokens={"a": 1, "b": 2}, total_num_scheduled_tokens=3, finished_req_ids=set())
    runner.states.update(step2, True)
    inputs = buffers.prepare(step2, runner.input_batch)
    assert buffers.slot_mapping.np[:3].tolist() == [30, 11, 20]
    assert buffers.positions.np[:3].tolist() == [6, 3, 4]
    assert buffers.input_ids.np[:3].tolist() == [99, 33, 34]
    assert inputs.sampling_rows.tolist() == [0, 1] and inputs.logits_indices.tolist() == [0, 2]
    assert np.array_equal(buffers.block_table[:2, :2].numpy(), [[3, 7], [2, 5]])


def test_second_execute_model_without_sampling_is_an_error() -> None:
    runner = make_runner()
    runner.execute_model_state = object()  # a step whose logits were never sampled
    with pytest.raises(RuntimeError, match="without sample_tokens"):
        runner.execute_model(SchedulerOutput.empty())


def test_profile_run_is_a_full_size_forward(llama_path: Path) -> None:
    config = make_engine_config(model=str(llama_path), max_num_batched_tokens=64, max_num_seqs=4)
    init_model_parallel(1, 1)
    runner = ModelRunner(resolve_engine_config(config), torch.device("cpu"))
    runner.load_model()
    scratch_bytes = runner.profile_run()  # before the KV cache: its scratch cache is dropped again
    assert scratch_bytes > 0
    assert runner.kv_caches == [] and runner.execute_model_state is None
    assert all(layer.kv_cache.numel() == 0 for layer in runner.attention_layers())
