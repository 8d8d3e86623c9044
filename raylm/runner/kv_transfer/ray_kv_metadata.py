"""What RayKVConnector's scheduler side tells its worker side per step (the transfers to send and to receive), and the
pair check: what a prefill's kv_transfer_params say of its KV, and why a decode engine refuses it."""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field
from typing import Any

from raylm.common.kv_transfer import KVConnectorMetadata
from raylm.configs.kv_identity import KVIdentity


def prompt_digest(token_ids: list[int]) -> str:
    return hashlib.sha256(array("q", token_ids).tobytes()).hexdigest()


def lora_key(request: Any) -> str | None:
    """The request's LoRA adapter as two engines can compare it (its name and folder: ids are engine-local)."""
    lora = request.lora_request
    return None if lora is None else f"{lora.lora_name}@{lora.lora_path}"


def pair_fields(request: Any, identity: KVIdentity) -> dict[str, Any]:
    """The prefill side's params that decide whether its KV is the decode side's (besides tokens and layout)."""
    return {"remote_prompt_digest": prompt_digest(request.prompt_token_ids),
            "remote_kv_identity": identity.as_dict(), "remote_lora": lora_key(request)}


def pair_mismatch(request: Any, params: dict[str, Any], identity: KVIdentity, block_size: int, num_layers: int
                  ) -> str | None:
    """Why the prefill's KV (its params) is not what this engine would compute for the request, or None."""
    different = identity.mismatch(params.get("remote_kv_identity"))
    if different is not None:
        return different
    if params.get("remote_lora") != lora_key(request):
        return f"it was computed under LoRA adapter {params.get('remote_lora')!r}, here {lora_key(request)!r}"
    expected = {"remote_num_tokens": request.num_prompt_tokens, "remote_block_size": block_size,
                "remote_num_layers": num_layers}
    for name, value in expected.items():
        if params.get(name) != value:
            return f"{name} is {params.get(name)!r}, here {value!r}"
    if request.num_output_tokens:
        return "the request has output tokens already"
    if params.get("remote_prompt_digest") != prompt_digest(request.prompt_token_ids):
        return "it was computed for another prompt"
    return None


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
