"""The scheduler with a KV connector, driven by test_scheduler's fake runner (no model, no Ray): a request whose
external KV arrived holds its blocks, so it is admitted ahead of the waiting queue; behind a preempted request that
cannot fit while it holds them, both would wait for good."""
from __future__ import annotations

from typing import Any

import torch

from raylm.cluster.core.request import RequestStatus
from raylm.cluster.core.scheduler import Scheduler
from raylm.common.kv_transfer import KVConnectorMetadata, KVConnectorOutput
from raylm.common.outputs import SchedulerOutput
from raylm.configs import make_engine_config
from raylm.configs.engine_config import CacheConfig, SchedulerConfig
from raylm.runner.kv_transfer import KVConnectorBase, KVConnectorRole
from tests.test_scheduler import BLOCK_SIZE, FakeRunner, Result, collect, make_request


class ExternalPrefixConnector(KVConnectorBase):
    """Scheduler side only: offers the KV of every prompt token but the last for the requests named in `external`;
    the test says when it arrived (KVConnectorOutput.finished_recving)."""

    def __init__(self, external: set[str]) -> None:
        super().__init__(make_engine_config(block_size=BLOCK_SIZE), KVConnectorRole.SCHEDULER)
        self.external = external
        self.allocated: dict[str, list[int]] = {}

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if request.request_id not in self.external or request.request_id in self.allocated:
            return 0, False
        return request.num_prompt_tokens - 1 - num_computed_tokens, True

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        if num_external_tokens:
            self.allocated[request.request_id] = block_ids

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context: Any) -> None:
        raise AssertionError("scheduler side only")

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise AssertionError("scheduler side only")

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        raise AssertionError("scheduler side only")

    def wait_for_save(self) -> None:
        raise AssertionError("scheduler side only")


def test_arrived_request_goes_ahead_of_a_preempted_one() -> None:
    # 10 blocks of 4 tokens. "grow" (16 prompt tokens, 20 to generate) needs 9 blocks by its end; "remote" (21 prompt
    # tokens, 20 of them external) holds 5 while its KV arrives. Its KV arrives once "grow" holds the other 5; it
    # needs a 6th block for its last prompt token, so it waits, and "grow" is preempted for its own 6th. Were "grow"
    # admitted first again, it would grow into its 6th block and be preempted over and over, "remote" never running.
    connector = ExternalPrefixConnector({"remote"})
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4),
                          CacheConfig(block_size=BLOCK_SIZE), 40, 10, BLOCK_SIZE, kv_connector=connector)
    runner, results = FakeRunner(), {}
    grow, remote = make_request("grow", 16, max_tokens=20), make_request("remote", 21, max_tokens=4)
    scheduler.add_request(grow)
    scheduler.add_request(remote)
    arrived = KVConnectorOutput()
    for _ in range(60):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        model_output = runner.execute(out)
        if remote.status == RequestStatus.WAITING_FOR_REMOTE_KVS and scheduler.kv_cache_manager.num_free_blocks == 0:
            arrived.finished_recving.add("remote")  # its KV arrives once "grow" took the last free block
        model_output.kv_connector_output, arrived = arrived, KVConnectorOutput()
        collect(results, scheduler.update_from_output(out, model_output))
    assert scheduler.num_preemptions >= 1
    assert _finished(results, "grow", 20) and _finished(results, "remote", 4)
    assert results["remote"].num_cached_tokens == 20  # the external KV was used, not recomputed
    assert scheduler.kv_cache_manager.num_free_blocks == 10


def _finished(results: dict[str, Result], req_id: str, num_tokens: int) -> bool:
    result = results.get(req_id)
    return result is not None and result.finish_reason == "length" and len(result.token_ids) == num_tokens
