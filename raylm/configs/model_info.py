"""Facts read from the checkpoint that every layer needs: resolved once, checked against the settings."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from raylm.configs.engine_config import ModelConfig, ParallelConfig

_DTYPES = {"float32", "float16", "bfloat16"}


@dataclass(frozen=True)
class ModelInfo:
    path: str
    tokenizer: str
    architecture: str
    vocab_size: int
    num_hidden_layers: int
    max_position_embeddings: int
    max_model_len: int
    dtype: str  # "float32" | "float16" | "bfloat16"
    eos_token_ids: tuple[int, ...]
    num_experts: int = 0  # routed experts per MoE layer; 0 for a dense model

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def dp_lockstep(self, parallel: ParallelConfig) -> bool:
        """Whether the DP engines step in lock-step: MoE with expert parallel over more than one DP rank, whose
        expert all_to_all every DP rank must join on every forward. Otherwise DP engines are independent."""
        return self.is_moe and parallel.enable_expert_parallel and parallel.data_parallel_size > 1

    def check_parallel(self, parallel: ParallelConfig) -> None:
        """Reject parallel settings this checkpoint cannot honour."""
        if parallel.enable_expert_parallel and not self.is_moe:
            raise ValueError(f"enable_expert_parallel: {self.architecture} has no experts (not a MoE model)")
        if parallel.enable_expert_parallel:
            ep_size = parallel.tensor_parallel_size * (parallel.data_parallel_size if self.dp_lockstep(parallel)
                                                       else 1)
            if self.num_experts % ep_size:
                raise ValueError(f"enable_expert_parallel: {self.num_experts} experts cannot be split evenly over "
                                 f"{ep_size} expert-parallel ranks (data_parallel_size x tensor_parallel_size)")


def read_model_info(model_config: ModelConfig, device_type: str) -> ModelInfo:
    assert model_config.model is not None, "the default model is built before model info is read"
    path = Path(model_config.model)
    config_file = path / "config.json"
    if not config_file.exists():
        raise ValueError(f"model: {path} is not a Hugging Face checkpoint folder (no config.json)")
    hf = json.loads(config_file.read_text())
    text_config = hf.get("text_config", hf)
    architectures = hf.get("architectures") or []
    if not architectures:
        raise ValueError(f"model: {config_file} names no `architectures`")
    max_positions = int(text_config.get("max_position_embeddings", 2048))
    max_model_len = model_config.max_model_len or max_positions
    if max_model_len > max_positions:
        raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's max_position_embeddings "
                         f"({max_positions})")
    return ModelInfo(
        path=str(path),
        tokenizer=model_config.tokenizer or str(path),
        architecture=architectures[0],
        vocab_size=int(text_config["vocab_size"]),
        num_hidden_layers=int(text_config["num_hidden_layers"]),
        max_position_embeddings=max_positions,
        max_model_len=max_model_len,
        dtype=_resolve_dtype(model_config.dtype, text_config, device_type),
        eos_token_ids=_eos_token_ids(path, hf),
        num_experts=int(text_config.get("num_experts") or text_config.get("num_local_experts") or 0),
    )


def _resolve_dtype(dtype: str, hf: dict, device_type: str) -> str:
    if dtype != "auto":
        return dtype
    if device_type == "cpu":
        return "float32"  # CPU half-precision matmuls are slow and the transformers oracle runs fp32
    checkpoint = str(hf.get("dtype") or hf.get("torch_dtype") or "bfloat16")
    return checkpoint if checkpoint in _DTYPES and checkpoint != "float32" else "bfloat16"


def _eos_token_ids(path: Path, hf: dict) -> tuple[int, ...]:
    ids: set[int] = set()
    sources = [hf]
    generation_file = path / "generation_config.json"
    if generation_file.exists():
        sources.append(json.loads(generation_file.read_text()))
    for source in sources:
        eos = source.get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(i) for i in eos)
    return tuple(sorted(ids))
