"""What raylm does not run of a quantized checkpoint is refused by name: schemes at resolution, before anything loads
(the folders here hold no weights at all), and tampered tensors at load, naming the tensor."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from raylm.cluster import LLM
from raylm.cluster.models.tiny_model import make_tiny_model
from raylm.configs.engine_config import ModelConfig, ParallelConfig
from raylm.configs.model_info import read_model_info, resolve_quantization
from raylm.configs.parallel_checks import check_parallel_layout
from tests.quant_format_checkpoints import write_compressed_tensors, write_gptq

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True,
        "checkpoint_format": "gptq"}
CT_WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}


def compressed_tensors(fmt: str = "pack-quantized", weights: dict | None = None, inputs: dict | None = None) -> dict:
    group = {"format": fmt, "targets": ["Linear"], "weights": weights or CT_WEIGHTS, "input_activations": inputs}
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group},
            "ignore": ["lm_head"], "quantization_status": "compressed"}


@pytest.fixture(scope="module")
def float_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("qr") / "float", num_layers=2, hidden_size=64,
                           intermediate_size=128, vocab_size=512)


def config_only(float_path: Path, out: Path, quantization_config: dict) -> Path:
    """A folder with the float model's config.json plus `quantization_config`, and no weights."""
    out.mkdir(parents=True)
    config = json.loads((float_path / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return out


@pytest.mark.parametrize(("quantization_config", "message"), [
    ({**GPTQ, "bits": 3}, r"quantization_config.bits 3 .*2- and 3-bit"),
    ({**GPTQ, "bits": 2}, r"quantization_config.bits 2 "),
    ({**GPTQ, "group_size": 16}, r"quantization_config.group_size 16: .*multiple of 32"),
    ({**GPTQ, "checkpoint_format": "marlin"}, r"checkpoint_format 'marlin'"),
    ({**GPTQ, "lm_head": True}, r"quantization_config.lm_head true"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemv"},
     r"quantization_config.version 'gemv'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, r"quant_method 'bitsandbytes'"),
    (compressed_tensors("sparse-24-bitmask"), r"config_groups.group_0.format 'sparse-24-bitmask'"),
    (compressed_tensors(weights={**CT_WEIGHTS, "num_bits": 2}), r"config_groups.group_0.weights: int2"),
    (compressed_tensors(weights={**CT_WEIGHTS, "actorder": "dynamic"}), r"actorder 'dynamic'"),
    (compressed_tensors("float-quantized", {"num_bits": 8, "type": "float", "strategy": "channel"},
                        {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}),
     r"input_activations: float8 tensor dynamic False"),
    ({**compressed_tensors(), "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, r"kv_cache_scheme"),
])
def test_unsupported_scheme_is_refused_before_loading(float_path: Path, tmp_path: Path, quantization_config: dict,
                                                      message: str) -> None:
    path = config_only(float_path, tmp_path / "ckpt", quantization_config)
    with pytest.raises(ValueError, match=message):
        LLM(model=str(path), tokenizer=str(float_path), dtype="float32", max_model_len=64)


def test_format_is_decided_in_resolution(float_path: Path, tmp_path: Path) -> None:
    info = read_model_info(str(config_only(float_path, tmp_path / "gptq", GPTQ)))
    assert resolve_quantization(ModelConfig(model=info.path), info) == "gptq"
    assert resolve_quantization(ModelConfig(model=info.path, quantization="gptq"), info) == "gptq"
    with pytest.raises(ValueError, match=r"quantization 'int4': .* is already quantized \(gptq gptq, int4 weights"):
        resolve_quantization(ModelConfig(model=info.path, quantization="int4"), info)
    float_info = read_model_info(str(float_path))
    with pytest.raises(ValueError, match=r"quantization 'awq': .* has no quantization_config"):
        resolve_quantization(ModelConfig(model=str(float_path), quantization="awq"), float_info)


def test_activation_order_refuses_tensor_parallel(float_path: Path, tmp_path: Path) -> None:
    info = read_model_info(str(config_only(float_path, tmp_path / "gptq", {**GPTQ, "desc_act": True})))
    check_parallel_layout(info, ParallelConfig(tensor_parallel_size=1), "gptq", False)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2: quantization 'gptq' in activation order .*use 1"):
        check_parallel_layout(info, ParallelConfig(tensor_parallel_size=2), "gptq", False)


def _tamper_tensors(src: Path, out: Path, drop: str | None = None) -> Path:
    shutil.copytree(src, out)
    tensors = load_file(str(out / "model.safetensors"))
    if drop is not None:
        del tensors[drop]
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_missing_scales_are_refused_naming_the_tensor(float_path: Path, tmp_path: Path) -> None:
    ct = write_compressed_tensors(float_path, "w4a16-group-asym", tmp_path / "ct")
    tampered = _tamper_tensors(ct, tmp_path / "no-scale", drop="model.layers.1.mlp.down_proj.weight_scale")
    with pytest.raises(ValueError, match=r"checkpoint tensor model.layers.1.mlp.down_proj.weight_scale is missing"):
        LLM(model=str(tampered), dtype="float32", max_model_len=64)


def test_wrong_group_size_is_refused_naming_the_tensor(float_path: Path, tmp_path: Path) -> None:
    gptq = write_gptq(float_path, tmp_path / "gptq", desc_act=False, sym=False)
    tampered = _tamper_tensors(gptq, tmp_path / "group64")
    config = json.loads((tampered / "config.json").read_text())
    config["quantization_config"]["group_size"] = 64  # the tensors hold groups of 32
    (tampered / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"checkpoint tensor model.layers.0.mlp.down_proj.scales has shape \(4, 64\), "
                                         r"but group_size 64 over 128 input features needs \(2, 64\)"):
        LLM(model=str(tampered), dtype="float32", max_model_len=64)
