"""Parallel layouts a checkpoint cannot run fail when the config is resolved (raylm/configs/parallel_checks.py), with
the field, the model's number and the sizes that work, before Ray starts or anything is placed; layouts raylm's
layers do run (KV heads replicated over more ranks, experts kept whole by expert parallel) still resolve. Checkpoints
here are tiny, random and built once; device is cpu where a layout resolves, so that nothing connects to Ray."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from raylm import LLM
from raylm.cluster.engine.config_resolver import resolve_engine_config
from raylm.cluster.models.default_gguf import default_gguf_path
from raylm.cluster.models.tiny_model import make_tiny_model
from raylm.configs import EngineConfig, make_engine_config

SMALL = dict(max_model_len=128)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("parallel_shapes")
    small = dict(num_layers=2, vocab_size=512)
    return {
        # SmolLM2-135M's heads: 9 attention heads, 3 KV heads.
        "smol": make_tiny_model(root / "smol", hidden_size=144, num_heads=9, num_kv_heads=3, intermediate_size=384,
                                **small),
        "kv6": make_tiny_model(root / "kv6", hidden_size=192, num_heads=12, num_kv_heads=6, intermediate_size=400,
                               **small),
        # 320 over 4 ranks is 80 per rank: whole rows, but not whole 32-weight quantized blocks.
        "mlp320": make_tiny_model(root / "mlp320", hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=320,
                                  **small),
        "moe66": make_tiny_model(root / "moe66", arch="qwen3_moe", hidden_size=64, num_heads=4, num_kv_heads=2,
                                 intermediate_size=128, moe_intermediate_size=66, mlp_only_layers=[0], **small),
    }


@pytest.fixture(autouse=True)
def no_ray() -> Iterator[None]:
    assert not ray.is_initialized(), "these checks must run before any Ray"
    yield
    assert not ray.is_initialized(), "resolving (or refusing) the layout started Ray"


def resolve(model: Path | str, **settings: Any) -> EngineConfig:
    return resolve_engine_config(make_engine_config(model=str(model), **SMALL | settings))


def test_attention_heads_tp_refused_before_any_worker(shapes: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=r"^tensor_parallel_size 2: the model's 9 attention heads cannot be split "
                                         r"evenly over 2 ranks; use 1 or 3$"):
        LLM(model=str(shapes["smol"]), tensor_parallel_size=2, **SMALL)


@pytest.mark.skipif(default_gguf_path() is None, reason="SmolLM2 GGUF not fetched on this machine")
def test_default_model_tp2_refused_before_any_worker() -> None:
    with pytest.raises(ValueError, match=r"^tensor_parallel_size 2: the model's 9 attention heads .* use 1 or 3$"):
        LLM(tensor_parallel_size=2, **SMALL)


def test_kv_heads_split_or_replicated(shapes: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=r"^tensor_parallel_size 4: the model's 6 KV heads can be neither split "
                                         r"evenly over 4 ranks nor replicated on them \(4 is not a multiple of 6\); "
                                         r"use 1 or 2$"):
        resolve(shapes["kv6"], tensor_parallel_size=4)
    # More ranks than KV heads, a multiple of them: each rank holds one KV head, as QKVParallelLinear loads it.
    config = resolve(shapes["mlp320"], tensor_parallel_size=4, device="cpu")
    assert config.resolved.executor_backend == "ray"


def test_intermediate_size_refused(shapes: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=r"^tensor_parallel_size 3: the model's intermediate_size 400 cannot be split "
                                         r"evenly over 3 ranks; use 1 or 2$"):
        resolve(shapes["kv6"], tensor_parallel_size=3)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_blocks_must_stay_whole(shapes: dict[str, Path], quantization: str) -> None:
    with pytest.raises(ValueError, match=rf"^tensor_parallel_size 4: quantization '{quantization}' keeps weights in "
                                         r"32-weight blocks along the input, and the model's intermediate_size 320 "
                                         r"over 4 ranks is 80 per rank, not whole blocks; use 1 or 2$"):
        resolve(shapes["mlp320"], tensor_parallel_size=4, quantization=quantization)
    assert resolve(shapes["mlp320"], tensor_parallel_size=2, quantization=quantization, device="cpu").model_config \
        .quantization == quantization


def test_experts_intermediate_and_expert_parallel(shapes: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=r"^tensor_parallel_size 4: the model's experts' moe_intermediate_size 66 "
                                         r"cannot be split evenly over 4 ranks; use 1 or 2$"):
        resolve(shapes["moe66"], tensor_parallel_size=4)
    # Expert parallel keeps each expert whole: 4 experts, one per rank.
    resolve(shapes["moe66"], tensor_parallel_size=4, enable_expert_parallel=True, device="cpu")
    with pytest.raises(ValueError, match=r"^enable_expert_parallel: 4 experts cannot be split evenly over 3 "
                                         r"expert-parallel ranks .*; use 1, 2 or 4 ranks$"):
        resolve(shapes["moe66"], data_parallel_size=3, enable_expert_parallel=True)


def test_pipeline_stages_need_layers(shapes: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=r"^pipeline_parallel_size 3: the model has 2 layers, and every stage needs "
                                         r"at least one; use at most 2$"):
        resolve(shapes["mlp320"], pipeline_parallel_size=3)
    with pytest.raises(ValueError, match=r"^pp_layer_partition \[2, 1\]: it places 3 layers, and the model has 2$"):
        resolve(shapes["mlp320"], pipeline_parallel_size=2, pp_layer_partition=[2, 1])
    resolve(shapes["mlp320"], pipeline_parallel_size=2, pp_layer_partition=[1, 1], device="cpu")


def test_draft_model_shapes(shapes: dict[str, Path]) -> None:
    spec = {"method": "draft_model", "model": str(shapes["smol"]), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"^speculative_config.model: tensor_parallel_size 2 shards the draft too, "
                                         r"and the draft's 9 attention heads cannot be split evenly over 2 ranks; "
                                         r"use 1 \(the sizes both models split over\)$"):
        resolve(shapes["mlp320"], tensor_parallel_size=2, speculative_config=spec)
    config = resolve(shapes["mlp320"], speculative_config=spec, device="cpu")
    assert config.resolved is not None and config.resolved.draft_model_info is not None
