"""Phi-3 (fused qkv_proj / gate_up_proj, LongRoPE, partial rotary) token-exact with transformers, and YaRN's cos/sin
against transformers' own rotary modules."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.models.tiny_model import make_tiny_model
from raylm.runner import cpu_kernels
from raylm.runner.layers.rotary_embedding import get_rope
from raylm.runner.models.utils import get_rope_config
from tests.reference import TOP_K, assert_same_output, check_logprobs_close, hf_greedy
from tests.rope_checkpoints import widen_weights, with_config

MAX_TOKENS = 8
MAX_POSITION = 128
# kind -> original_max_position_embeddings, prompt lengths; both rotate half of each head. "longrope": the context
# (128) is past the original one (32), so raylm rotates with the long factors, as transformers does once a sequence is
# past 32 tokens: every prompt is. "longrope_short": the context is the original one, so both keep the short factors.
KINDS: dict[str, tuple[int, list[int]]] = {"longrope": (32, [33, 70]), "longrope_short": (MAX_POSITION, [3, 60])}
ENGINE = dict(max_model_len=MAX_POSITION, block_size=16, enable_prefix_caching=False, max_num_batched_tokens=32)
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)


def prompts_of(kind: str) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(5, 500) for _ in range(n)] for n in KINDS[kind][1]]


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("phi3")
    long = make_tiny_model(root / "longrope", arch="phi3", vocab_size=512, max_position_embeddings=MAX_POSITION,
                           rope_scaling="longrope", partial_rotary_factor=0.5,
                           original_max_position_embeddings=KINDS["longrope"][0])
    widen_weights(long)
    short = KINDS["longrope_short"][0]
    return {"longrope": long, "longrope_short": with_config(
        long, root / "longrope_short", original_max_position_embeddings=short,
        rope_parameters={"original_max_position_embeddings": short})}


@pytest.fixture(scope="module")
def references(phi3: dict[str, Path]) -> dict[str, list]:
    return {kind: hf_greedy(path, prompts_of(kind), MAX_TOKENS) for kind, path in phi3.items()}


def generate(llm: LLM, kind: str) -> list[tuple[list[int], list[dict[int, float]]]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts_of(kind)], PARAMS, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs]


@pytest.fixture(scope="module")
def single_device(phi3: dict[str, Path]) -> dict[str, list]:
    results = {}
    for kind, path in phi3.items():
        llm = LLM(model=str(path), **ENGINE)
        results[kind] = generate(llm, kind)
        llm.shutdown()
    return results


@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_matches_transformers(kind: str, references: dict[str, list], single_device: dict[str, list]) -> None:
    assert check_logprobs_close(references[kind], single_device[kind], kind) == 0


def test_plain_torch_path_matches_transformers(phi3: dict[str, Path], references: dict[str, list]) -> None:
    """custom_ops="none": rotary (partial, LongRoPE-scaled) and attention on their torch paths."""
    llm = LLM(model=str(phi3["longrope"]), custom_ops="none", **ENGINE)
    assert check_logprobs_close(references["longrope"], generate(llm, "longrope"), "longrope/torch") == 0
    llm.shutdown()


def test_long_factors_decide_the_tokens(phi3: dict[str, Path], references: dict[str, list],
                                        tmp_path: Path) -> None:
    """The long prompts really take the long factors: with the short ones in their place transformers' tokens
    change, so the parity above would catch raylm using the wrong set."""
    short_factor = json.loads((phi3["longrope"] / "config.json").read_text())["rope_parameters"]["short_factor"]
    swapped = with_config(phi3["longrope"], tmp_path / "swapped", rope_parameters={"long_factor": short_factor})
    swapped_tokens = hf_greedy(swapped, prompts_of("longrope"), MAX_TOKENS)
    assert all(a != b for (a, _), (b, _) in zip(swapped_tokens, references["longrope"], strict=True))


def test_cos_sin_match_transformers() -> None:
    """Each cache row is transformers' cos | sin at that position (attention factor included): LongRoPE long and
    short, partial rotary without scaling, and YaRN with and without DeepSeek's mscale pair."""
    common = dict(hidden_size=128, num_attention_heads=4, max_position_embeddings=256)
    longrope = {"rope_type": "longrope", "short_factor": [1.0 + i / 10 for i in range(8)],
                "long_factor": [1.0 + i for i in range(8)], "original_max_position_embeddings": 64}
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    cases: list[tuple[Any, Any, int]] = [
        (Phi3Config(**common, partial_rotary_factor=0.5, rope_scaling=longrope), Phi3RotaryEmbedding, 200),
        (Phi3Config(**{**common, "max_position_embeddings": 64}, partial_rotary_factor=0.5, rope_scaling=longrope),
         Phi3RotaryEmbedding, 60),
        (Phi3Config(**common, partial_rotary_factor=0.25), Phi3RotaryEmbedding, 256),
        (LlamaConfig(**common, rope_scaling=yarn), LlamaRotaryEmbedding, 250),
        (LlamaConfig(**common, rope_scaling={**yarn, "beta_fast": 16, "mscale": 1.0, "mscale_all_dim": 0.5}),
         LlamaRotaryEmbedding, 250),
    ]
    for config, hf_cls, length in cases:
        positions = torch.arange(length)
        cos, sin = hf_cls(config)(torch.zeros(1, dtype=torch.float32), positions[None])
        theta, scaling = get_rope_config(config)
        ours = get_rope(32, config.max_position_embeddings, theta, scaling).cos_sin_cache[positions]
        half = ours.shape[-1] // 2
        torch.testing.assert_close(ours, torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1), rtol=0, atol=1e-6)


def test_partial_rotary_kernel_matches_torch_path() -> None:
    """The CPU kernel rotates the first rotary_dim of each head from a scaled cache and leaves the rest, as the
    torch path does."""
    rope = get_rope(32, 128, 10000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
                    rotary_dim=16)
    positions = torch.tensor([0, 5, 31, 90, 127])
    q, k = torch.randn(5, 4 * 32), torch.randn(5, 2 * 32)
    cpu_kernels.set_enabled(False)
    expected = rope(positions, q.clone(), k.clone())
    cpu_kernels.set_enabled(True)
    assert cpu_kernels.ops_for(q) is not None, "the CPU kernels did not build"
    ours = rope(positions, q.clone(), k.clone())
    for a, b in zip(ours, expected, strict=True):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(ours[0].unflatten(-1, (4, 32))[..., 16:], q.unflatten(-1, (4, 32))[..., 16:])


def test_short_sliding_window_is_refused(phi3: dict[str, Path], tmp_path: Path) -> None:
    windowed = with_config(phi3["longrope"], tmp_path / "windowed", sliding_window=64)
    with pytest.raises(ValueError, match="sliding_window: 64 is shorter than max_position_embeddings"):
        LLM(model=str(windowed), **ENGINE)


def test_tp2_pp2_on_ray_matches_single_device(ray_cluster: Any, phi3: dict[str, Path],
                                             single_device: dict[str, list]) -> None:
    """TP=2 splits the fused qkv / gate_up weights per rank (2 KV heads, one each); PP=2 puts a layer per stage."""
    llm = LLM(model=str(phi3["longrope"]), tensor_parallel_size=2, pipeline_parallel_size=2,
              distributed_executor_backend="ray", **ENGINE)
    ours = generate(llm, "longrope")
    llm.shutdown()
    assert_same_output(ours, single_device["longrope"])
