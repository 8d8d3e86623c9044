"""Settings for KV transfer between engines and host memory (vLLM's `kv_transfer_config`), and for how requests are
routed over several engines or Serve replicas.

Both sections are flat like the others: `LLM(kv_connector="RayKVConnector", kv_role="kv_consumer")`, a YAML key or
`--kv-connector`. A nested `kv_transfer_config={...}` dict, as vLLM takes it, is accepted by make_engine_config too.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# The connectors raylm ships; any other is named by kv_connector with kv_connector_module_path.
KNOWN_KV_CONNECTORS = ("OffloadingConnector", "RayKVConnector")
KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
KVTransport = Literal["object_store", "p2p"]


class KVTransferConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kv_connector: str | None = Field(
        None, description="OffloadingConnector (evicted blocks to the node's host store, loaded back on a hit), "
                          "RayKVConnector (disaggregated prefill: KV from a prefill engine to a decode engine over "
                          "Ray's object store), or a class in kv_connector_module_path")
    kv_role: KVRole | None = Field(
        None, description="kv_producer (computes KV for others: a prefill engine), kv_consumer (receives it: a decode "
                          "engine) or kv_both; required with kv_connector")
    kv_connector_module_path: str | None = Field(
        None, description="import path of a module holding the kv_connector class (a KVConnectorBase subclass)")
    kv_offloading_size: float | None = Field(
        None, gt=0.0, description="GiB of host memory for offloaded KV blocks, per node (the first engine to create a "
                                  "node's store sets it); set alone it turns the OffloadingConnector on")
    kv_transfer_timeout_s: float = Field(
        30.0, gt=0.0, description="how long a decode engine waits for a prefill's KV (then it recomputes), and how "
                                  "long an untaken transfer is kept")
    kv_transport: KVTransport = Field(
        "object_store", description="RayKVConnector: how a prefill engine's KV reaches a decode engine: object_store "
                                    "(through Ray's object store, device to host and back) or p2p (a direct "
                                    "torch.distributed channel between the two workers: gloo on CPU, NCCL on CUDA). "
                                    "The prefill engine's setting decides; a decode engine takes either")

    @model_validator(mode="after")
    def _check(self) -> KVTransferConfig:
        if self.kv_connector is None:
            if self.kv_role is not None or self.kv_connector_module_path is not None:
                raise ValueError("kv_role and kv_connector_module_path need kv_connector")
            if self.kv_transport != "object_store":
                raise ValueError(f"kv_transport {self.kv_transport!r} needs kv_connector RayKVConnector")
            return self
        if self.kv_role is None:
            raise ValueError(f"kv_role: required with kv_connector {self.kv_connector!r} (kv_producer, kv_consumer "
                             f"or kv_both)")
        if self.kv_connector_module_path is None and self.kv_connector not in KNOWN_KV_CONNECTORS:
            raise ValueError(f"kv_connector {self.kv_connector!r} is not one of raylm's {list(KNOWN_KV_CONNECTORS)}; "
                             f"name its module with kv_connector_module_path")
        if self.kv_connector == "OffloadingConnector" and self.kv_role != "kv_both":
            raise ValueError("kv_role: the OffloadingConnector both saves and loads KV: use kv_both")
        if self.kv_transport != "object_store" and self.kv_connector == "OffloadingConnector":
            raise ValueError(f"kv_transport {self.kv_transport!r}: the OffloadingConnector keeps blocks in the object "
                             f"store; kv_transport is RayKVConnector's")
        return self


class RoutingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    routing_policy: Literal["auto", "load", "prefix"] = Field(
        "auto", description="how requests are spread over data-parallel engines and Serve replicas: load (the "
                            "least loaded), prefix (the one holding the longest cached prefix of the prompt while "
                            "loads are within routing_imbalanced_threshold); auto: prefix where prefix caching is on")
    routing_imbalanced_threshold: float = Field(
        8.0, ge=0.0, description="prefix routing: loads (4 x waiting + running per engine; ongoing requests per "
                                 "replica) further apart than this route to the least loaded")
    routing_match_rate_threshold: float = Field(
        0.1, ge=0.0, le=1.0, description="prefix routing: a best match covering less of the prompt than this "
                                         "fraction routes to the least loaded")
