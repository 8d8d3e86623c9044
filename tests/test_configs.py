"""Settings load from YAML and keywords; an unknown key or an impossible value names the field."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from raylm.common.sampling_params import SamplingParams
from raylm.configs import make_engine_config


def test_yaml_then_overrides(tmp_path: Path) -> None:
    config = make_engine_config("raylm/configs/tiny.yaml", max_num_seqs=3)
    assert config.scheduler_config.max_num_seqs == 3
    assert config.cache_config.block_size == 16
    assert config.parallel_config.distributed_executor_backend == "uni"

    custom = tmp_path / "custom.yaml"
    custom.write_text("block_size: 32\ntensor_parallel_size: 2\n")
    config = make_engine_config(custom, block_size=8)
    assert config.cache_config.block_size == 8
    assert config.parallel_config.world_size == 2


@pytest.mark.parametrize("settings, message", [
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(block_size="big"), "block_size"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(no_such_setting=1), "unknown setting(s) ['no_such_setting']"),
    (dict(distributed_executor_backend="mpi"), "distributed_executor_backend"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=128), "max_num_batched_tokens"),
    (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold"),
    (dict(enable_chunked_prefill=False, long_prefill_token_threshold=64), "needs enable_chunked_prefill"),
    (dict(pipeline_parallel_size=2, pp_layer_partition=[1, 1, 1]), "pp_layer_partition"),
    (dict(min_replicas=3, max_replicas=2), "min_replicas"),
])
def test_bad_settings_name_the_field(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        make_engine_config(**settings)


def test_bad_yaml(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ValueError, match="mapping"):
        make_engine_config(bad)
    with pytest.raises(FileNotFoundError):
        make_engine_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize("settings, field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(n=0), "n"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(stop=[""]), "stop"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
])
def test_bad_sampling_params_name_the_field(settings: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{field} "):
        SamplingParams(**settings)


def test_kv_identity_names_what_differs(llama_path: Path, tmp_path: Path) -> None:
    """Two engines share KV only under one identity: the same checkpoint by another spelling of its path is the same;
    another dtype, quantization, or another checkpoint put at the same path is not, and the mismatch names the field."""
    from raylm.configs.kv_identity import kv_identity

    here = kv_identity(str(llama_path), "float32", "none")
    assert kv_identity(str(llama_path / "."), "float32", "none") == here
    assert here.mismatch(here.as_dict()) is None
    assert here.mismatch(kv_identity(str(llama_path), "bfloat16", "int8").as_dict()) == (
        "dtype 'bfloat16' there, 'float32' here; quantization 'int8' there, 'none' here")
    copy = tmp_path / "model"
    shutil.copytree(llama_path, copy)
    before = kv_identity(str(copy), "float32", "none")
    with (copy / "model.safetensors").open("ab") as weights:
        weights.write(b"\0" * 8)  # another checkpoint's weights at the same path
    assert kv_identity(str(copy), "float32", "none").checkpoint != before.checkpoint
