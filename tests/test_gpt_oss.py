"""GPT-OSS (attention sinks, sliding-window layers alternating with full ones, biased attention, YaRN, biased experts
with the clamped SwiGLU, top-k then softmax routing) token-exact with transformers on a tiny random checkpoint,
through prefill, chunked prefill past the window and decode steps, in the cpu and torch attention backends; TP=2 x
PP=2 on Ray, with and without expert parallel, equal one device; served through the OpenAI client with the
openai_gptoss reasoning parser."""
from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GptOssConfig

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.models.tiny_tokenizer import build_tokenizer
from raylm.configs.attention_backends import attention_features, choose_attention_backend
from raylm.configs.environment import EnvironmentFacts
from raylm.runner.layers.gpt_oss_experts import GptOssExperts
from tests.http_server import served_engine
from tests.reference import TOP_K, assert_same_output, check_logprobs_close, hf_greedy
from tests.runner_steps import model_parallel_of_one  # noqa: F401 (fixture)

MAX_TOKENS = 8
WINDOW = 8
PROMPT_LENGTHS = (5, 21, 45)  # one inside the window, two past it (the last in two chunks)
ENGINE = dict(max_model_len=128, block_size=16, enable_prefix_caching=False, max_num_batched_tokens=32)
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)
# head_dim * heads (128) != hidden_size (64), as in the real models; 4 layers: sliding, full, sliding, full.
SHAPES = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
              max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
              rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                               "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0})
Result = list[tuple[list[int], list[dict[int, float]]]]
# The harmony markers gpt-oss's tokenizer has as special tokens (<|start|> and <|end|> the tiny tokenizer has already).
HARMONY = ["<|channel|>", "<|message|>", "<|call|>", "<|return|>", "<|constrain|>"]


def widen(model: torch.nn.Module) -> None:
    """Weights drawn wide enough that each part decides tokens: norms around 1, the rest std 0.1, the sinks std 2
    (some rows give the sink most of their weight), the experts' gate/up std 0.5 (some values pass the clamp at 7)."""
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if "norm" in name:
                tensor.uniform_(0.5, 1.5)
            else:
                tensor.normal_(0.0, 2.0 if "sinks" in name else 0.5 if name.endswith("gate_up_proj") else 0.1)


def write_checkpoint(path: Path) -> Path:
    tokenizer = build_tokenizer(512)
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY})
    config = GptOssConfig(vocab_size=len(tokenizer), architectures=["GptOssForCausalLM"], **SHAPES)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    widen(model)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(5, 500) for _ in range(n)] for n in PROMPT_LENGTHS]


def run(path: Path, **settings: Any) -> Result:
    llm = LLM(model=str(path), **{**ENGINE, **settings})
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("gpt_oss") / "tiny-gpt-oss")


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> Result:
    return hf_greedy(checkpoint, prompts(), MAX_TOKENS)


@pytest.fixture(scope="module")
def single_device(checkpoint: Path) -> Result:
    return run(checkpoint, attention_backend="cpu")


def assert_matches(reference: Result, ours: Result, name: str) -> None:
    assert check_logprobs_close(reference, ours, name) == 0
    for (_, ref_top), (_, our_top) in zip(reference, ours, strict=True):
        for ref_at, our_at in zip(ref_top, our_top, strict=True):
            assert all(abs(ref_at[t] - our_at[t]) < 1e-4 for t in ref_at if t in our_at), name


@pytest.mark.usefixtures("model_parallel_of_one")
def test_experts_match_transformers() -> None:
    """The router and experts against transformers' GptOssMLP, loaded from its fused, interleaved, transposed
    tensors; with gate/up values past the clamp, which a plain SwiGLU would not cut."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = GptOssConfig(**SHAPES)
    torch.manual_seed(1)
    mlp = GptOssMLP(config)
    widen(mlp)
    hidden = torch.randn(40, config.hidden_size)
    with torch.no_grad():
        expected = mlp(hidden[None])[0][0]
        gate_up = hidden @ mlp.experts.gate_up_proj + mlp.experts.gate_up_proj_bias[:, None]
    assert gate_up.abs().max() > 2 * config.swiglu_limit  # the clamp is reached
    experts = GptOssExperts(config.num_local_experts, config.num_experts_per_tok, config.hidden_size,
                            config.intermediate_size, config.swiglu_alpha, config.swiglu_limit)
    for name, param in experts.named_parameters():
        param.weight_loader(param, getattr(mlp.experts, name).detach())  # type: ignore[attr-defined]
    with torch.no_grad():
        torch.testing.assert_close(experts(hidden, mlp.router(hidden)[0]), expected, rtol=1e-5, atol=1e-5)
        experts.limit = float("inf")
        assert not torch.allclose(experts(hidden, mlp.router(hidden)[0]), expected, atol=1e-3)


def test_backends_with_sinks() -> None:
    """GPT-OSS's attention needs sinks and windows: auto takes the cpu kernel on CPU, flash_attn is never taken."""
    features = attention_features(GptOssConfig(architectures=["GptOssForCausalLM"], **SHAPES))
    assert features == {"sinks", "sliding_window"}
    assert choose_attention_backend("auto", "cpu", "float32", 16, True, EnvironmentFacts(), features) == "cpu"
    with pytest.raises(ValueError, match="the flash_attn kernel has no attention sinks or sliding window"):
        choose_attention_backend("flash_attn", "cuda", "bfloat16", 256, True, EnvironmentFacts(), features)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_greedy_matches_transformers(backend: str, checkpoint: Path, reference: Result,
                                     single_device: Result) -> None:
    """Chunked prefill (the 45-token prompt in two steps, the second over cached context) and decodes, windowed; the
    torch backend with plain-torch layers (custom_ops none), as where raylm's CPU kernels do not run."""
    ours = single_device if backend == "cpu" else run(checkpoint, attention_backend=backend, custom_ops="none")
    assert_matches(reference, ours, f"gpt_oss/{backend}")


def test_one_step_prefill_and_prefix_caching(checkpoint: Path, reference: Result) -> None:
    """Whole prompts in one step (the kernel's fresh-prompt tasks), then the same prompts again from the prefix cache:
    their last chunk attends through its window, sinks included, over cached blocks."""
    llm = LLM(model=str(checkpoint), **{**ENGINE, "max_num_batched_tokens": 256, "enable_prefix_caching": True})
    try:
        runs = [llm.generate([{"prompt_token_ids": p} for p in prompts()], PARAMS, use_tqdm=False) for _ in range(2)]
    finally:
        llm.shutdown()
    for outputs, name in zip(runs, ("one_step", "prefix_cached"), strict=True):
        assert_matches(reference, [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs], name)
    assert runs[1][-1].num_cached_tokens > 0


def test_sinks_decide_the_output(checkpoint: Path, reference: Result, tmp_path: Path) -> None:
    """Without the sinks (a logit far below every score) transformers' tokens change: the parity above would catch
    raylm dropping them."""
    sinkless = shutil.copytree(checkpoint, tmp_path / "sinkless")
    weights = load_file(sinkless / "model.safetensors")
    weights = {name: t.fill_(-1e4) if name.endswith("sinks") else t for name, t in weights.items()}
    save_file(weights, sinkless / "model.safetensors", metadata={"format": "pt"})
    assert hf_greedy(sinkless, prompts()[2:], MAX_TOKENS)[0][0] != reference[2][0]  # one prompt, the longest, shows it


def test_tp2_pp2_on_ray_matches_single_device(ray_cluster: Any, checkpoint: Path, single_device: Result) -> None:
    """TP=2: two of the four query heads (and their sinks), one KV head, half of each expert's intermediate size
    per rank; PP=2: a sliding and a full layer per stage."""
    ours = run(checkpoint, attention_backend="cpu", tensor_parallel_size=2, pipeline_parallel_size=2,
               distributed_executor_backend="ray")
    assert_same_output(ours, single_device)


def test_tp2_pp2_ep_on_ray_matches_single_device(ray_cluster: Any, checkpoint: Path, single_device: Result) -> None:
    """Expert parallel over the two TP ranks: two of the four experts each, whole, with their biases; every rank
    routes its slice of the tokens through the all_to_all (tests/test_gpt_oss_ep.py: the fixed-capacity exchange)."""
    ours = run(checkpoint, attention_backend="cpu", tensor_parallel_size=2, pipeline_parallel_size=2,
               enable_expert_parallel=True, distributed_executor_backend="ray")
    assert_same_output(ours, single_device)


def test_openai_server(checkpoint: Path, reference: Result) -> None:
    """Through the OpenAI client: completions give transformers' greedy text; with the openai_gptoss reasoning
    parser a chat keeps the harmony markers (special tokens) in the text it parses, whole and streamed (the output
    forced to <|message|>, a message with no channel: content as it is)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    marker = tokenizer.convert_tokens_to_ids("<|message|>")
    with served_engine(checkpoint, max_model_len=128, reasoning_parser="openai_gptoss") as (server, _):
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        for prompt, (tokens, _) in zip(prompts(), reference, strict=True):
            text = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text
            # The detokenizer holds back an unfinished UTF-8 sequence at the end (random tokens split characters).
            assert text.rstrip("\ufffd") == tokenizer.decode(tokens, skip_special_tokens=True).rstrip("\ufffd")
        chat: dict[str, Any] = dict(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                    temperature=0, logit_bias={str(marker): 100})
        message = client.chat.completions.create(**chat).choices[0].message
        assert message.content == "<|message|>" * 3 and getattr(message, "reasoning_content", None) is None
        chunks = list(client.chat.completions.create(**chat, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message.content
