"""What RayKVConnector's scheduler side tells its worker side per step: the transfers to send and to receive."""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field
from typing import Any

from raylm.common.kv_transfer import KVConnectorMetadata


def prompt_digest(token_ids: list[int]) -> str:
    return hashlib.sha256(array("q", token_ids).tobytes()).hexdigest()


@dataclass
class SendJob:
    request_id: str
    key: str
    block_ids: list[int]  # the prompt's blocks
    refs: dict[str, list[Any]] = field(default_factory=dict)  # layer name -> [ObjectRef] once put


@dataclass
class RecvJob:
    request_id: str
    key: str
    source: dict[str, Any]  # where the prefill's params say the KV is: remote_store, or remote_host / remote_port
    first_block: int  # the prompt's blocks from this one on are loaded (the ones before are cached here)
    block_ids: list[int]
    timeout_s: float


@dataclass
class RayKVMetadata(KVConnectorMetadata):
    sends: list[SendJob] = field(default_factory=list)
    recvs: list[RecvJob] = field(default_factory=list)
