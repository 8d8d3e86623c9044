"""What the ModelRunner does with its worker-side connector around each step (vLLM's KVConnectorModelRunnerMixin):
bind the step's metadata and start the loads before the forward; after it, wait for the saves, collect the finished
transfers and failed loads into the step's KVConnectorOutput, and clear the metadata. A step without tokens runs the
same calls without a forward."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from raylm.common.kv_transfer import KVConnectorOutput
from raylm.common.outputs import SchedulerOutput
from raylm.configs import EngineConfig
from raylm.runner.kv_transfer.base import KVConnectorBase, KVConnectorRole, kv_layer_name
from raylm.runner.kv_transfer.factory import KVConnectorFactory

# How long a step without a forward waits for a transfer to finish: an engine with nothing else to do then polls the
# transfers a few hundred times a second instead of spinning.
_NO_FORWARD_WAIT_S = 0.005


def create_worker_connector(config: EngineConfig, kv_caches: dict[int, torch.Tensor]) -> KVConnectorBase | None:
    """The worker side of the engine's connector over the KV caches by layer index, or None without one."""
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER)
    if connector is not None:
        connector.register_kv_caches({kv_layer_name(index): kv_caches[index] for index in sorted(kv_caches)})
    return connector


@contextmanager
def kv_connector_step(connector: KVConnectorBase | None, scheduler_output: SchedulerOutput
                      ) -> Iterator[KVConnectorOutput | None]:
    """Around one forward; the output yielded is filled once the block exits (None without a connector)."""
    if connector is None:
        yield None
        return
    metadata = scheduler_output.kv_connector_metadata
    assert metadata is not None, "a connector's step carries its metadata (the scheduler's build_connector_meta)"
    connector.bind_connector_metadata(metadata)
    output = KVConnectorOutput()
    try:
        connector.start_load_kv(None)
        yield output
        connector.wait_for_save()
        sending, recving = connector.get_finished(scheduler_output.finished_req_ids)
        output.finished_sending, output.finished_recving = sending or set(), recving or set()
        output.invalid_block_ids = connector.get_block_ids_with_load_errors()
    finally:
        connector.clear_connector_metadata()


def kv_connector_no_forward(connector: KVConnectorBase, scheduler_output: SchedulerOutput) -> KVConnectorOutput:
    """A step without tokens: the connector calls alone, with a short wait for a transfer to finish in place of the
    forward."""
    with kv_connector_step(connector, scheduler_output) as output:
        connector.wait_for_transfers(_NO_FORWARD_WAIT_S)
    assert output is not None
    return output
