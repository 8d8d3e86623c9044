"""A RayKVConnector that writes down each connector call it gets, in order, then does what the real one does: loaded by
the engines of tests/test_kv_connector.py through kv_connector_module_path, as any custom connector is."""
from __future__ import annotations

from typing import Any

from raylm.runner.kv_transfer.ray_kv_connector import RayKVConnector

CALLS: list[tuple[str, str]] = []  # (role, method): both sides of every engine in this process, in call order

_RECORDED = (
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "update_connector_output",
    "request_finished", "bind_connector_metadata", "start_load_kv", "wait_for_layer_load", "save_kv_layer",
    "wait_for_save", "get_finished", "get_block_ids_with_load_errors", "clear_connector_metadata",
)


def _recording(name: str) -> Any:
    def call(self: RayKVConnector, *args: Any, **kwargs: Any) -> Any:
        CALLS.append((self.config.kv_transfer_config.kv_role or "", name))
        return getattr(RayKVConnector, name)(self, *args, **kwargs)

    call.__name__ = name
    return call


RecordingRayKVConnector = type("RecordingRayKVConnector", (RayKVConnector,), {name: _recording(name)
                                                                               for name in _RECORDED})
