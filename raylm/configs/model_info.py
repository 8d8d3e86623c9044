"""Facts read from the checkpoint that every layer needs: read once, on the driver, when the engine's config is
resolved, and handed to every worker with it (the workers read no config.json of their own)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raylm.configs.engine_config import ModelConfig
from raylm.configs.gguf_metadata import is_gguf, read_gguf_config
from raylm.configs.kv_identity import checkpoint_identity
from raylm.configs.quant_formats import resolve_checkpoint_quantization

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_DTYPES = {"float32", "float16", "bfloat16"}
# The quantizations whose weights `auto` computes in bfloat16 on CPU (resolve_dtype): blocks, and checkpoints
# quantized as shipped (configs/quant_formats.py), whose weights round by as much as bfloat16 or more.
BF16_QUANTIZATIONS = ("gguf", "int8", "int4", "compressed-tensors", "gptq", "awq")


@dataclass(frozen=True)
class ModelInfo:
    """What the checkpoint says. The decisions taken from it (dtype, max_model_len, tokenizer) are the resolver's, kept
    in ModelConfig."""

    path: str
    architecture: str
    vocab_size: int
    num_hidden_layers: int
    max_position_embeddings: int
    checkpoint_dtype: str | None  # config.json's torch_dtype, when it names a float type
    eos_token_ids: tuple[int, ...]
    num_experts: int = 0  # routed experts per MoE layer; 0 for a dense model
    hf_config: PretrainedConfig | None = None  # transformers' config of the checkpoint, which the model is built from
    # The checkpoint's resolved path and a digest of its files (configs/kv_identity.py): what its KV identity names.
    checkpoint: tuple[str, str] = ("", "")
    # The object-storage URI `path` was copied from ("" for a local checkpoint): each worker loads its own node's copy.
    source: str = ""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def read_model_info(model_path: str) -> ModelInfo:
    """The checkpoint's facts, its config read once through transformers' AutoConfig (which the models take)."""
    from transformers import AutoConfig

    path = Path(model_path)
    config_file = path / "config.json"
    if is_gguf(path):
        hf_config = read_gguf_config(path)
    elif config_file.exists():
        hf_config = AutoConfig.from_pretrained(str(path))
    else:
        raise ValueError(f"model: {path} is neither a Hugging Face checkpoint folder (no config.json) nor a .gguf file")
    hf = hf_config.to_dict()
    text_config = hf.get("text_config", hf)
    architectures = hf.get("architectures") or []
    if not architectures:
        raise ValueError(f"model: {path} names no `architectures`")
    checkpoint_dtype = str(text_config.get("dtype") or text_config.get("torch_dtype") or "").removeprefix("torch.")
    return ModelInfo(
        path=str(path),
        architecture=architectures[0],
        vocab_size=int(text_config["vocab_size"]),
        num_hidden_layers=int(text_config["num_hidden_layers"]),
        max_position_embeddings=int(text_config.get("max_position_embeddings", 2048)),
        checkpoint_dtype=checkpoint_dtype if checkpoint_dtype in _DTYPES else None,
        eos_token_ids=_eos_token_ids(path, hf),
        num_experts=int(text_config.get("num_experts") or text_config.get("num_local_experts")
                        or text_config.get("n_routed_experts") or 0),  # Qwen3-MoE, Mixtral, DeepSeek
        hf_config=hf_config,
        checkpoint=checkpoint_identity(str(path)),
    )


def resolve_dtype(model_config: ModelConfig, model_info: ModelInfo, device_type: str, cpu_bf16_instructions: str
                  ) -> str:
    """The dtype setting, or for "auto":
    - on CPU, bfloat16 where the CPU multiplies bfloat16 in hardware (`cpu_bf16_instructions` names them: the
      environment's fact, from cpu_bf16_instructions()) and the weights are either
      stored in 16 bits (bfloat16 or float16) or quantized (a GGUF file's blocks, `int8`, `int4`, a checkpoint
      quantized as shipped): activations, KV cache and attention in bfloat16, each quantized linear planned per
      shape and rows between its block kernels (and, on a CPU without AMX, the float kernels on a bfloat16
      dequantized copy: runner/layers/quantization/block_quant.py). A 16-bit checkpoint loses nothing that matters,
      and a quantized weight already rounds each weight by about as much as bfloat16 (Q8_0) or more (4 bits); both ran
      faster than float32 (docs/cpu-performance.md). Their accuracy rule is the 16-bit parity rule: transformers'
      greedy tokens in bfloat16, except at a near-tie. Else float32: a float32 checkpoint keeps the precision it
      was stored in (and the transformers oracle's), and without bfloat16 instructions every product widens first.
    - elsewhere, the checkpoint's 16-bit dtype (bfloat16 for a float32 checkpoint)."""
    if model_config.dtype != "auto":
        return model_config.dtype
    checkpoint = model_info.checkpoint_dtype
    if device_type == "cpu":
        return "bfloat16" if _bf16_weights(model_config, model_info) and cpu_bf16_instructions else "float32"
    return checkpoint if checkpoint is not None and checkpoint != "float32" else "bfloat16"


def explain_dtype(model_config: ModelConfig, model_info: ModelInfo, device_type: str, cpu_bf16_instructions: str
                  ) -> str:
    """The resolved dtype and why, for the engine-config line: e.g. "bfloat16 (auto: quantized gguf weights, CPU has
    AVX512-BF16)", "float32 (auto: float32 checkpoint)", "float32 (set)"."""
    dtype = resolve_dtype(model_config, model_info, device_type, cpu_bf16_instructions)
    if model_config.dtype != "auto":
        return f"{dtype} (set)"
    if device_type != "cpu":
        return f"{dtype} (auto: {model_info.checkpoint_dtype or 'float32'} checkpoint on {device_type})"
    weights = _bf16_weights(model_config, model_info)
    if weights is None:
        return f"{dtype} (auto: {model_info.checkpoint_dtype or 'float32'} checkpoint)"
    if dtype == "float32":
        return f"{dtype} (auto: {weights}, but no bfloat16 dot products on this CPU)"
    return f"{dtype} (auto: {weights}, CPU has {cpu_bf16_instructions})"


def _bf16_weights(model_config: ModelConfig, model_info: ModelInfo) -> str | None:
    """What makes the weights fit bfloat16 compute (quantized, or stored in 16 bits), or None."""
    quantization = resolve_quantization(model_config, model_info)
    if quantization in BF16_QUANTIZATIONS:
        return f"quantized {quantization} weights"
    if model_info.checkpoint_dtype in ("bfloat16", "float16"):
        return f"{model_info.checkpoint_dtype} checkpoint"
    return None


def cpu_bf16_instructions() -> str:
    """This CPU's bfloat16 dot-product instructions by name ("AVX512-BF16 and AMX-BF16"), "" where it has none that
    raylm's kernels and oneDNN use (cpu_multiplies_bf16): an environment fact (configs/environment.py)."""
    if not cpu_multiplies_bf16():
        return ""
    flags = _cpu_flags()
    return " and ".join(name for flag, name in (("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX-BF16"))
                        if flag in flags) or "bfloat16 dot products"


def _cpu_flags() -> set[str]:
    try:
        return next((set(line.split()) for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags")), set())
    except OSError:
        return set()


@cache
def cpu_multiplies_bf16() -> bool:
    """Whether this CPU has bfloat16 dot products in hardware (AVX512-BF16 or AMX-BF16 among its flags: raylm's
    kernels use the first, oneDNN both) and torch's oneDNN runs bfloat16 here (its own ISA check)."""
    if not {"avx512_bf16", "amx_bf16"} & _cpu_flags():
        return False
    import torch  # here, not at import: the config layer is read by processes that never compute

    # (torch leaves mkldnn.is_available unannotated.)
    return bool(torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
                and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_quantization(model_config: ModelConfig, model_info: ModelInfo) -> str:
    """The quantization setting, or for None: gguf (the file's own block formats) for a GGUF file, a quantized
    checkpoint's format (configs/quant_formats.py), else none."""
    gguf_file = is_gguf(model_info.path)
    checkpoint_format = None if gguf_file else resolve_checkpoint_quantization(model_config.quantization, model_info)
    if checkpoint_format is not None:
        return checkpoint_format
    method = model_config.quantization or ("gguf" if gguf_file else "none")
    if method == "gguf" and not gguf_file:
        raise ValueError("quantization: 'gguf' keeps a GGUF file's own formats, and the model is not a .gguf file "
                         "(use 'int8' or 'int4' to quantize a float checkpoint)")
    return method


def resolve_max_model_len(model_config: ModelConfig, model_info: ModelInfo) -> int:
    max_positions = model_info.max_position_embeddings
    max_model_len = model_config.max_model_len or max_positions
    if max_model_len > max_positions:
        raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's max_position_embeddings "
                         f"({max_positions})")
    return max_model_len


def _eos_token_ids(path: Path, hf: dict[str, Any]) -> tuple[int, ...]:
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
