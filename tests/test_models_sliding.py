"""Mistral (sliding window), Gemma 2 (alternating windows, soft-capped scores and logits) and Gemma 3 (mixed local /
global layers, q/k norm, two rotary bases) token-exact with transformers through the engine, windows shorter than the
prompts; and the choice of an attention backend that has what the model's attention needs."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.models.tiny_model import make_tiny_model
from raylm.configs.attention_backends import (
    attention_features,
    choose_attention_backend,
    explain_attention_backend,
    layer_sliding_windows,
)
from raylm.configs.environment import EnvironmentFacts
from raylm.runner.models.cpu_layer_stack import why_not_stacked
from raylm.runner.models.loader import load_model
from tests.http_server import served_engine
from tests.reference import TOP_K, assert_same_output, check_logprobs_close, hf_greedy
from tests.rope_checkpoints import widen_weights
from tests.runner_steps import model_parallel_of_one

MAX_TOKENS = 8
WINDOW = 8
PROMPT_LENGTHS = [5, 21, 45]  # one inside the window, two past it (the last in two chunks)
ENGINE = dict(max_model_len=128, block_size=16, enable_prefix_caching=False, max_num_batched_tokens=32)
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)
COMMON = dict(vocab_size=512, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128,
              max_position_embeddings=128)
ARCHS: dict[str, dict[str, Any]] = {
    "mistral": dict(arch="mistral", num_layers=2, sliding_window=WINDOW),
    "gemma2": dict(arch="gemma2", num_layers=2, sliding_window=WINDOW, attn_logit_softcapping=1.0,
                   final_logit_softcapping=2.0),
    # Layers sliding, global, sliding, global: local and global rotary bases and windows mixed.
    "gemma3": dict(arch="gemma3", num_layers=4, sliding_window=WINDOW, sliding_window_pattern=2,
                   final_logit_softcapping=2.0),
}
KINDS = [*ARCHS, "gemma2_uncapped"]  # the last: Gemma 2's weights with neither soft-cap


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(5, 500) for _ in range(n)] for n in PROMPT_LENGTHS]


def with_config(source: Path, out: Path, **changes: Any) -> Path:
    """A copy of checkpoint `source` whose config.json takes `changes`."""
    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **changes}))
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sliding")
    built = {}
    for arch, settings in ARCHS.items():  # built once per machine in the user cache, widened in a copy
        built[arch] = shutil.copytree(make_tiny_model(**COMMON, **settings), root / arch)
        widen_weights(built[arch])
    built["gemma2_uncapped"] = with_config(built["gemma2"], root / "gemma2_uncapped", attn_logit_softcapping=None,
                                           final_logit_softcapping=None)
    return built


@pytest.fixture(scope="module")
def references(checkpoints: dict[str, Path]) -> dict[str, list]:
    return {kind: hf_greedy(path, prompts(), MAX_TOKENS) for kind, path in checkpoints.items()}


def generate(path: Path, **engine: Any) -> list[tuple[list[int], list[dict[int, float]]]]:
    llm = LLM(model=str(path), **{**ENGINE, **engine})
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], PARAMS, use_tqdm=False)
    llm.shutdown()
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs]


def assert_logprobs_equal(reference: list, ours: list) -> None:
    """Beyond the tokens: the logprobs of transformers' top-5 agree, which the final soft-cap changes (it keeps the
    greedy token: tanh is monotonic)."""
    for (ref_tokens, ref_top), (our_tokens, our_top) in zip(reference, ours, strict=True):
        assert ref_tokens == our_tokens
        for ref_at, our_at in zip(ref_top, our_top, strict=True):
            assert all(abs(ref_at[t] - our_at[t]) < 1e-4 for t in ref_at if t in our_at)


@pytest.mark.parametrize(("kind", "backend", "max_num_seqs"), [
    *((kind, "auto", 16) for kind in KINDS), ("mistral", "torch", 16), ("gemma2", "torch", 16),
])
def test_greedy_matches_transformers(kind: str, backend: str, max_num_seqs: int, checkpoints: dict[str, Path],
                                     references: dict[str, list]) -> None:
    """Chunked prefill (the 45-token prompt in two steps, the second over cached context) and decodes, windowed; auto
    is raylm's cpu kernel here."""
    ours = generate(checkpoints[kind], attention_backend=backend, max_num_seqs=max_num_seqs)
    assert check_logprobs_close(references[kind], ours, f"{kind}/{backend}") == 0
    assert_logprobs_equal(references[kind], ours)


def test_window_and_caps_decide_the_output(checkpoints: dict[str, Path], references: dict[str, list],
                                          tmp_path: Path) -> None:
    """Without the window, or without Gemma 2's caps, transformers' tokens change; without Gemma 3's final cap its
    logprobs do (tanh keeps the greedy token): the parity above would catch raylm dropping any of them."""
    unwindowed = hf_greedy(with_config(checkpoints["mistral"], tmp_path / "unwindowed", sliding_window=None),
                           prompts(), MAX_TOKENS)
    assert [t for t, _ in unwindowed] != [t for t, _ in references["mistral"]]
    assert [t for t, _ in references["gemma2_uncapped"]] != [t for t, _ in references["gemma2"]]
    no_final = hf_greedy(with_config(checkpoints["gemma3"], tmp_path / "no_final", final_logit_softcapping=None),
                         prompts()[:1], MAX_TOKENS)
    assert no_final[0][1][0] != references["gemma3"][0][1][0]


def test_one_step_prefill_and_prefix_caching(checkpoints: dict[str, Path], references: dict[str, list]) -> None:
    """Whole prompts in one step (the fresh-prompt paths, padded and packed), then the same prompts again from the
    prefix cache: their last chunk attends through its window over cached blocks."""
    llm = LLM(model=str(checkpoints["gemma3"]), **{**ENGINE, "max_num_batched_tokens": 256,
                                                   "enable_prefix_caching": True})
    runs = [llm.generate([{"prompt_token_ids": p} for p in prompts()], PARAMS, use_tqdm=False) for _ in range(2)]
    llm.shutdown()
    for outputs, name in zip(runs, ("one_step", "prefix_cached"), strict=True):
        ours = [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs]
        assert check_logprobs_close(references["gemma3"], ours, f"gemma3/{name}") == 0
    assert runs[1][-1].num_cached_tokens > 0


def test_openai_server_serves_transformers_tokens(checkpoints: dict[str, Path], references: dict[str, list]) -> None:
    """Through the OpenAI app: /v1/completions on token-id prompts returns transformers' greedy text and logprobs."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoints["gemma2"])
    with served_engine(checkpoints["gemma2"], max_model_len=128) as (server, _):
        model = server.request("GET", "/v1/models")[1]["data"][0]["id"]
        for prompt, (tokens, top) in zip(prompts(), references["gemma2"], strict=True):
            status, body = server.request("POST", "/v1/completions", {
                "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "logprobs": 1})
            assert status == 200, body
            choice = body["choices"][0]
            # The detokenizer holds back an unfinished UTF-8 sequence at the end (random tokens split characters).
            assert choice["text"].rstrip("\ufffd") == tokenizer.decode(tokens).rstrip("\ufffd")
            assert [abs(lp - max(at.values())) < 1e-4 for lp, at in zip(choice["logprobs"]["token_logprobs"], top,
                                                                      strict=True)] == [True] * MAX_TOKENS


def test_tp2_pp2_on_ray_matches_single_device(ray_cluster: Any, checkpoints: dict[str, Path]) -> None:
    """TP=2 over gloo (each rank one of the two KV heads) and PP=2 (a sliding and a global layer per stage; the
    embedding's scale on the first, the tied head and final cap on the last)."""
    single = generate(checkpoints["gemma3"])
    ours = generate(checkpoints["gemma3"], tensor_parallel_size=2, pipeline_parallel_size=2,
                    distributed_executor_backend="ray")
    assert_same_output(ours, single)


@pytest.mark.usefixtures(model_parallel_of_one.__name__)
def test_fused_cpu_layers_leave_windowed_layers(checkpoints: dict[str, Path]) -> None:
    """Mistral's layers are Llama's, but the fused CPU layer stack applies no window: they run module by module (the
    stack takes a step only where this machine's linear plans say skinny, so the engine tests cannot be relied on to
    reach it)."""
    from transformers import AutoConfig

    model = load_model(checkpoints["mistral"], AutoConfig.from_pretrained(checkpoints["mistral"]))
    assert why_not_stacked(model) == ("its attention has a sliding window or a logit soft-cap, which the fused layers "
                                      "do not apply")


def test_layer_windows_and_features(checkpoints: dict[str, Path]) -> None:
    from transformers import AutoConfig

    gemma3 = AutoConfig.from_pretrained(checkpoints["gemma3"])
    assert layer_sliding_windows(gemma3) == [WINDOW, None, WINDOW, None]
    assert attention_features(gemma3) == {"sliding_window"}  # Gemma 3 does not cap its scores
    assert attention_features(AutoConfig.from_pretrained(checkpoints["gemma2"])) == {"sliding_window",
                                                                                    "logits_soft_cap"}
    mistral = AutoConfig.from_pretrained(checkpoints["mistral"])
    assert layer_sliding_windows(mistral) == [WINDOW, WINDOW]
    mistral.sliding_window = 128  # as long as max_position_embeddings: it hides nothing
    assert attention_features(mistral) == frozenset()
    assert attention_features(None) == frozenset()


def test_backend_choice_follows_the_model() -> None:
    env = EnvironmentFacts()  # every kernel available
    window, both = frozenset({"sliding_window"}), frozenset({"sliding_window", "logits_soft_cap"})
    # raylm's cpu kernel has both; on CUDA flash_attn has neither and the triton kernel both.
    assert choose_attention_backend("auto", "cpu", "float32", 16, True, env, both) == "cpu"
    assert explain_attention_backend("auto", "cpu", "float32", 16, True, env, both) == "cpu"
    assert choose_attention_backend("auto", "cuda", "bfloat16", 256, True, env) == "flash_attn"
    assert explain_attention_backend("auto", "cuda", "bfloat16", 256, True, env, both) == \
        "triton (the flash_attn kernel has no logit soft-capping or sliding window)"
    assert explain_attention_backend("auto", "cuda", "bfloat16", 256, True,
                                     EnvironmentFacts(missing_kernels={"triton": "no triton"}), window) == \
        "torch (the flash_attn kernel has no sliding window)"
    with pytest.raises(ValueError, match="attention_backend 'flash_attn' is not available: the flash_attn kernel has "
                                         "no sliding window, which this model's attention uses; use 'triton', "
                                         "'torch' or 'auto'"):
        choose_attention_backend("flash_attn", "cuda", "bfloat16", 256, True, env, window)
