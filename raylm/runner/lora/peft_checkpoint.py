"""Read a PEFT LoRA checkpoint (adapter_config.json + adapter_model.safetensors) and check it against the base model.

PEFT saves `base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r] per targeted linear, and
applies `lora_B(lora_A(x)) * scaling` with scaling = lora_alpha / r (lora_alpha / sqrt(r) under use_rslora). raylm
takes LoRA on the decoder's seven linears; everything else PEFT can save (DoRA, biases, embedding or head adapters,
modules_to_save, per-module rank or alpha patterns) is refused with the adapter's name and what it asked for.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from raylm.common.object_storage import is_object_uri, local_copy

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PREFIX = "base_model.model."


class LoRACheckpointError(ValueError):
    """An adapter this engine cannot serve; the message names the adapter and the rule."""


@dataclass
class LoRALayerWeights:
    """One targeted linear of the checkpoint, full (unsharded): lora_b already carries the scaling."""

    lora_a: torch.Tensor  # [rank, in_features]
    lora_b: torch.Tensor  # [out_features, rank], times scaling


@dataclass
class LoRAModel:
    """An adapter read from disk: its rank and its weights by module name ("model.layers.0.self_attn.q_proj")."""

    name: str
    rank: int
    layers: dict[str, LoRALayerWeights]


def expected_shapes(hf_config: PretrainedConfig) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each supported linear of the base model, by module kind."""
    hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = hf_config.intermediate_size
    return {"q_proj": (heads * head_dim, hidden), "k_proj": (kv_heads * head_dim, hidden),
            "v_proj": (kv_heads * head_dim, hidden), "o_proj": (hidden, heads * head_dim),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}


def read_adapter_config(name: str, path: str | Path) -> dict:
    folder = Path(path)
    config_file = folder / ADAPTER_CONFIG
    if not config_file.is_file() or not (folder / ADAPTER_WEIGHTS).is_file():
        raise LoRACheckpointError(f"LoRA adapter {name!r}: {folder} is not a PEFT adapter folder (it needs "
                                  f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    config = json.loads(config_file.read_text())
    refusals = {
        "peft_type": config.get("peft_type", "LORA") != "LORA",
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") != "none",
        "modules_to_save": bool(config.get("modules_to_save")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
    }
    asked = [f"{key}={config.get(key)!r}" for key, refused in refusals.items() if refused]
    if asked:
        raise LoRACheckpointError(f"LoRA adapter {name!r}: raylm serves plain LoRA (peft_type LORA, no DoRA, no bias, "
                                  f"no modules_to_save, one rank and alpha); this adapter has {', '.join(asked)}")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(SUPPORTED_MODULES))
        if unknown:
            raise LoRACheckpointError(f"LoRA adapter {name!r}: target modules {unknown} are not LoRA-capable "
                                      f"modules of the model (raylm applies LoRA to {list(SUPPORTED_MODULES)})")
    return config


def check_adapter(name: str, path: str | Path, hf_config: PretrainedConfig, max_lora_rank: int) -> int:
    """Check an adapter against the base model without reading its weights (tensor headers only); returns its rank."""
    return _read(name, path, hf_config, max_lora_rank, load=False).rank


def load_lora_model(name: str, path: str | Path, hf_config: PretrainedConfig, max_lora_rank: int,
                    dtype: torch.dtype) -> LoRAModel:
    return _read(name, path, hf_config, max_lora_rank, load=True, dtype=dtype)


def _read(name: str, path: str | Path, hf_config: PretrainedConfig, max_lora_rank: int, load: bool,
          dtype: torch.dtype = torch.float32) -> LoRAModel:
    if is_object_uri(path):  # this node's copy: the engine's check and each worker's load share it
        path = local_copy(str(path), f"LoRA adapter {name!r}")
    config = read_adapter_config(name, path)
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    if rank > max_lora_rank:
        raise LoRACheckpointError(f"LoRA adapter {name!r}: its rank {rank} is over max_lora_rank ({max_lora_rank})")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    shapes, num_layers = expected_shapes(hf_config), hf_config.num_hidden_layers
    base = config.get("base_model_name_or_path")
    pairs: dict[str, dict[str, torch.Tensor | tuple[int, ...]]] = {}
    with safe_open(str(Path(path) / ADAPTER_WEIGHTS), framework="pt", device="cpu") as f:
        for key in f.keys():
            module, part = _split_key(name, key)
            kind = module.rsplit(".", 1)[-1]
            if kind not in SUPPORTED_MODULES or not _is_decoder_linear(module, num_layers):
                raise LoRACheckpointError(f"LoRA adapter {name!r}: it targets {module!r}, which is not a LoRA-capable "
                                          f"module of the model (raylm applies LoRA to {list(SUPPORTED_MODULES)} "
                                          f"of layers 0..{num_layers - 1})")
            shape = tuple(f.get_slice(key).get_shape())
            out_features, in_features = shapes[kind]
            wanted = (rank, in_features) if part == "lora_A" else (out_features, rank)
            if shape != wanted:
                raise LoRACheckpointError(
                    f"LoRA adapter {name!r}: {key} has shape {list(shape)}, the base model needs {list(wanted)} (rank "
                    f"{rank}); it was trained for another base model ({base or 'not named in its config'})")
            pairs.setdefault(module, {})[part] = f.get_tensor(key) if load else shape
    incomplete = sorted(module for module, parts in pairs.items() if len(parts) != 2)
    if not pairs:
        raise LoRACheckpointError(f"LoRA adapter {name!r}: no LoRA weights in {ADAPTER_WEIGHTS}")
    if incomplete:
        raise LoRACheckpointError(f"LoRA adapter {name!r}: lora_A or lora_B is missing for {', '.join(incomplete)}")
    layers = {}
    if load:
        for module, parts in pairs.items():
            lora_a, lora_b = parts["lora_A"], parts["lora_B"]
            assert isinstance(lora_a, torch.Tensor) and isinstance(lora_b, torch.Tensor)
            layers[module] = LoRALayerWeights(lora_a.to(dtype), (lora_b.float() * scaling).to(dtype))
    return LoRAModel(name, rank, layers)


def _split_key(name: str, key: str) -> tuple[str, str]:
    """"base_model.model.model.layers.0.mlp.up_proj.lora_A.weight" -> ("model.layers.0.mlp.up_proj", "lora_A")."""
    stem = key.removeprefix(_PREFIX)
    for part in ("lora_A", "lora_B"):
        suffix = f".{part}.weight"
        if stem.endswith(suffix):
            return stem.removesuffix(suffix), part
    raise LoRACheckpointError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA weight raylm can apply "
                              f"(expected <module>.lora_A.weight / <module>.lora_B.weight)")


def _is_decoder_linear(module: str, num_layers: int) -> bool:
    parts = module.split(".")  # model.layers.<i>.<self_attn|mlp>.<kind>
    return (len(parts) == 5 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
            and int(parts[2]) < num_layers and parts[3] in ("self_attn", "mlp"))
