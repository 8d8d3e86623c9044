"""KVIdentity: everything about an engine that changes the values of the KV it computes for a token sequence, decided
once when the config is resolved and read by the KV connectors. Two engines share KV only when their identities are
equal: the OffloadingConnector keys the node's store by its digest, and RayKVConnector's decode side refuses a
prefill's KV whose identity differs, naming the field.

The fields: the checkpoint (its resolved path, which for a Hugging Face cache snapshot names the revision, and a digest
of its config and weight files' names and sizes, so that another checkpoint put at the same path does not match), the
dtype (raylm's KV cache is in the model's dtype: there is no separate kv_cache_dtype) and the quantization. A
request's LoRA adapter changes its KV too: it is in the request's block hashes (the offload key) and in the prefill's
kv_transfer_params, per request.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

# The files whose content or size decides the weights of a Hugging Face checkpoint folder.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


@dataclass(frozen=True)
class KVIdentity:
    model: str  # the checkpoint folder or GGUF file, resolved
    checkpoint: str  # digest of config.json and the weight files' names and sizes
    dtype: str  # of the weights' compute and of the KV cache
    quantization: str

    def as_dict(self) -> dict[str, str]:
        return asdict(self)

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def mismatch(self, other: dict[str, str] | None) -> str | None:
        """What differs between this identity and another engine's (as_dict), naming each field; None if nothing."""
        if other is None:
            return "it names no KV identity (model, checkpoint, dtype, quantization)"
        ours = self.as_dict()
        differ = [f"{name} {other.get(name)!r} there, {value!r} here" for name, value in ours.items()
                  if other.get(name) != value]
        return "; ".join(differ) or None


def kv_identity(model_path: str, dtype: str, quantization: str) -> KVIdentity:
    return KVIdentity(*checkpoint_identity(model_path), dtype, quantization)


def checkpoint_identity(model_path: str) -> tuple[str, str]:
    """(the checkpoint's resolved path, its digest): read with the checkpoint's other facts (read_model_info), so
    that resolution builds the KVIdentity without reading files."""
    path = Path(model_path).resolve()
    return str(path), _checkpoint_digest(path)


def _checkpoint_digest(path: Path) -> str:
    digest = hashlib.sha256()
    if path.is_file():  # a GGUF file: its config is in its header, which its size covers poorly, so hash the head
        with path.open("rb") as file:
            digest.update(file.read(1 << 20))
        digest.update(str(os.path.getsize(path)).encode())
        return digest.hexdigest()[:16]
    config = path / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    for weight in sorted(p for p in path.iterdir() if p.suffix in _WEIGHT_SUFFIXES):
        digest.update(f"{weight.name}:{weight.stat().st_size}\n".encode())
    return digest.hexdigest()[:16]
