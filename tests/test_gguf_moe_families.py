"""GGUF files of the MoE families (Mixtral, Qwen3-MoE, DeepSeek V2 / V3, GPT-OSS), written by the test from tiny random
checkpoints (2 layers, 4 experts) as llama.cpp's converter writes them (tests/gguf_files.py, tests/gguf_moe_files.py):
the config read from the metadata against the checkpoint's own, and raylm's greedy tokens and logprobs on the file
against transformers on the checkpoint (its weights rounded through the file's block format where the file is
quantized), in float32."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, DeepseekV2Config, DeepseekV3Config, GptOssConfig
from transformers.integrations.gguf.gguf_tokenizer_mapping import set_split_regex

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.models.tiny_model import make_tiny_model
from raylm.cluster.models.tiny_tokenizer import build_tokenizer
from raylm.configs.gguf_metadata import gguf_tokenizer, read_gguf_config
from raylm.runner.layers.fused_moe import FusedMoE
from raylm.runner.models.gguf_weights import iterate_gguf_weights
from raylm.runner.models.loader import load_model
from tests.gguf_files import write_gguf
from tests.reference import TOP_K, check_logprobs_close, hf_greedy
from tests.runner_steps import model_parallel_of_one  # noqa: F401 (fixture)

Q = gguf.GGMLQuantizationType
MAX_POSITION = 128
PROMPTS = [list(range(40, 70)), [7, 300, 12, 5] * 6]
MAX_TOKENS = 6
TINY = dict(vocab_size=512, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96, num_experts=4,
            max_position_embeddings=MAX_POSITION)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 0.707,
        "mscale_all_dim": 0.707, "rope_theta": 10000.0, "beta_fast": 32.0, "beta_slow": 1.0}
DEEPSEEK = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                max_position_embeddings=MAX_POSITION, rms_norm_eps=1e-6, tie_word_embeddings=False)
# V2 without q-lora, group-limited greedy softmax routing and DeepSeek's YaRN; V3 with q-lora, sigmoid routing with
# the correction bias, renormalised weights (rope dims in adjacent pairs, as DeepSeek's checkpoints and llama.cpp
# have them).
DEEPSEEK_KINDS: dict[str, tuple[Any, dict[str, Any]]] = {
    "deepseek_v2": (DeepseekV2Config, dict(q_lora_rank=None, topk_method="group_limited_greedy", rope_parameters=YARN)),
    "deepseek_v3": (DeepseekV3Config, dict(q_lora_rank=32, norm_topk_prob=True, rope_interleave=True,
                                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}
GPT_OSS = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
               max_position_embeddings=MAX_POSITION, rms_norm_eps=1e-5, tie_word_embeddings=False,
               rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": False, "original_max_position_embeddings": 32, "rope_theta": 150000.0})
# (family, linear type, expert type): float32, but GPT-OSS's experts in MXFP4, the type llama.cpp keeps them in.
# Qwen3-MoE in Q8_0 runs over TP=2 with expert parallel (test_tp2_with_expert_parallel_on_ray).
CASES = [("mixtral", Q.F32, Q.F32), ("qwen3_moe", Q.F32, Q.F32), ("deepseek_v2", Q.F32, Q.F32),
         ("deepseek_v3", Q.F32, Q.F32), ("gpt_oss", Q.F32, Q.MXFP4)]
Result = list[tuple[list[int], list[dict[int, float]]]]


def _widened(model: torch.nn.Module, path: Path, tokenizer: Any) -> Path:
    """transformers' model saved with its weights drawn wide (norms around 1, the rest std 0.1, GPT-OSS's sinks std 2)
    so that attention, the routing and every expert decide tokens."""
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name:
                tensor.uniform_(0.5, 1.5)
            elif tensor.is_floating_point() and "rotary" not in name:
                tensor.normal_(0.0, 2.0 if "sinks" in name else 0.1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _checkpoint(family: str, root: Path) -> Path:
    if family in ("mixtral", "qwen3_moe"):
        return make_tiny_model(root / family, arch=family, **TINY)
    tokenizer = build_tokenizer(512)
    if family == "gpt_oss":
        config = GptOssConfig(vocab_size=len(tokenizer), architectures=["GptOssForCausalLM"], **GPT_OSS)
    else:
        cls, fields = DEEPSEEK_KINDS[family]
        config = cls(vocab_size=len(tokenizer), architectures=[f"{cls.__name__[:-6]}ForCausalLM"], **DEEPSEEK,
                     **fields)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (tokenizer.bos_token_id, tokenizer.eos_token_id,
                                                                     tokenizer.pad_token_id)
    torch.manual_seed(0)
    return _widened(AutoModelForCausalLM.from_config(config, dtype=torch.float32), root / family, tokenizer)


def _rounded(checkpoint: Path, out: Path, linear: Q, experts: Q) -> Path:
    """The checkpoint with each weight the file quantizes rounded through its type, along the rows the file stores
    (GPT-OSS's experts are [experts, in, out] in the checkpoint, transposed in the file)."""
    def round_trip(weight: np.ndarray, qtype: Q, transposed: bool) -> np.ndarray:
        if qtype == Q.F32:
            return weight
        rows = weight.swapaxes(-1, -2) if transposed else weight
        rows = gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(rows), qtype), qtype)
        return np.ascontiguousarray(rows.swapaxes(-1, -2) if transposed else rows)

    shutil.copytree(checkpoint, out)
    tensors = load_file(checkpoint / "model.safetensors")
    for name, weight in tensors.items():
        if weight.ndim >= 2 and "gate.weight" not in name and "router" not in name and "bias" not in name:
            gpt_oss_expert = name.endswith(("experts.gate_up_proj", "experts.down_proj"))
            tensors[name] = round_trip(weight, experts if ".experts." in name else linear, gpt_oss_expert)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {family: _checkpoint(family, root) for family in dict.fromkeys(case[0] for case in CASES)}


@pytest.fixture(scope="module", params=CASES, ids=lambda case: f"{case[0]}-{case[1].name}-{case[2].name}")
def gguf_file(request: pytest.FixtureRequest, checkpoints: dict[str, Path],
              tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, tuple[Q, Q]]:
    """(the HF checkpoint, the GGUF written from it, (linear type, expert type))."""
    family, linear, experts = request.param
    out = tmp_path_factory.mktemp("gguf") / f"{family}-{linear.name}-{experts.name}.gguf"
    return (checkpoints[family], write_gguf(checkpoints[family], out, linear, embedding_type=linear,
                                            expert_type=experts), (linear, experts))


CONFIG_KEYS = ("architectures", "model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "hidden_size", "intermediate_size", "tie_word_embeddings", "num_local_experts", "num_experts",
               "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers", "sliding_window",
               "layer_types", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
               "n_routed_experts", "n_shared_experts", "first_k_dense_replace", "routed_scaling_factor", "n_group",
               "topk_group", "rope_interleave", "swiglu_limit", "attention_bias", "rope_parameters")


def test_config_from_metadata(gguf_file: tuple[Path, Path, tuple[Q, Q]]) -> None:
    checkpoint, path, _ = gguf_file
    ours, original = read_gguf_config(path).to_dict(), json.loads((checkpoint / "config.json").read_text())
    for key in CONFIG_KEYS:
        if key in original:
            assert ours.get(key) == pytest.approx(original[key]), key
    if original["model_type"] == "deepseek_v2":  # V3 always routes noaux_tc
        assert ours["topk_method"] == original["topk_method"]


def test_generation_matches_transformers(gguf_file: tuple[Path, Path, tuple[Q, Q]], tmp_path: Path) -> None:
    """raylm in float32 on the file (experts restacked into its fused layers, DeepSeek's kv_b rebuilt from k_b / v_b,
    GPT-OSS's gate / up interleaved again, MXFP4 experts dequantized) generates what transformers generates from the
    checkpoint, and the chosen tokens' logprobs agree, which a small error (a routing rule, a rope scale) moves before
    it flips a token."""
    checkpoint, path, (linear, experts) = gguf_file
    rounded = linear != Q.F32 or experts != Q.F32
    reference = _rounded(checkpoint, tmp_path / "rounded", linear, experts) if rounded else checkpoint
    expected, ours = hf_greedy(reference, PROMPTS, MAX_TOKENS), _raylm(path)
    assert check_logprobs_close(expected, ours, path.name) == 0
    assert _chosen_logprob_error(expected, ours) < 1e-4, path.name


def _chosen_logprob_error(expected: Result, ours: Result) -> float:
    """The largest difference of the chosen tokens' logprobs, up to each sequence's first divergence."""
    errors = [0.0]
    for (tokens, ref_tops), (our_tokens, our_tops) in zip(expected, ours):
        for token, our_token, ref_top, our_top in zip(tokens, our_tokens, ref_tops, our_tops):
            if token != our_token:
                break
            errors.append(abs(ref_top[token] - our_top[token]))
    return max(errors)


def _raylm(path: Path) -> Result:
    llm = LLM(model=str(path), dtype="float32", max_model_len=MAX_POSITION, enable_prefix_caching=False)
    try:
        return _generate(llm)
    finally:
        llm.shutdown()


def _generate(llm: LLM) -> Result:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K),
                           use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs]


def test_deepseek_file_from_before_the_kv_b_split(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """A DeepSeek file as llama.cpp wrote them before splitting kv_b (`attn_kv_b` whole, every head a KV head, the
    head sizes as key / value lengths) reads as the same model, here in Q8_0: the linears keep their blocks but kv_b,
    which MLA multiplies by itself, loads dequantized. Against transformers on the checkpoint rounded through Q8_0
    (logprobs within 2e-2, one near-tie divergence allowed, as in the TP=2 test below)."""
    checkpoint = checkpoints["deepseek_v3"]
    path = write_gguf(checkpoint, tmp_path / "deepseek-kv_b.gguf", Q.Q8_0, Q.Q8_0, split_kv_b=False)
    assert "blk.1.attn_kv_b.weight" in {t.name for t in gguf.GGUFReader(path).tensors}
    ours, original = read_gguf_config(path).to_dict(), json.loads((checkpoint / "config.json").read_text())
    for key in ("num_key_value_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank"):
        assert ours[key] == original[key], key
    expected = hf_greedy(_rounded(checkpoint, tmp_path / "rounded", Q.Q8_0, Q.Q8_0), PROMPTS, MAX_TOKENS)
    ours_result = _raylm(path)
    assert check_logprobs_close(expected, ours_result, path.name) <= 1
    assert _chosen_logprob_error(expected, ours_result) < 2e-2


@pytest.mark.usefixtures("model_parallel_of_one")
def test_pipeline_stages_load_their_layers(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Each of PP=2's stages reads only its own layers' tensors from a DeepSeek file (the first dense, the second with
    experts and a split kv_b), each equal to the one-stage model's."""
    path = write_gguf(checkpoints["deepseek_v3"], tmp_path / "deepseek.gguf", Q.F32, Q.F32)
    config = read_gguf_config(path)
    whole = dict(load_model(path, config).named_parameters())
    for rank in (0, 1):
        stage = dict(load_model(path, config, pp_rank=rank, pp_size=2).named_parameters())
        assert {name.split(".")[2] for name in stage if name.startswith("model.layers.")} == {str(rank)}
        for name, param in stage.items():
            assert torch.equal(param, whole[name]), name
        other = f"model.layers.{1 - rank}."
        read = [name for name, _ in iterate_gguf_weights(path, config,
                                                         skip=lambda name, prefix=other: name.startswith(prefix))]
        assert read and not any(name.startswith(other) for name in read)


def test_tp2_with_expert_parallel_on_ray(checkpoints: dict[str, Path], tmp_path: Path, ray_cluster: None) -> None:
    """A Qwen3-MoE file in Q8_0 over TP=2 with expert parallel on Ray (each rank two experts; the linears keep their
    blocks, split by rows or by whole blocks) generates what transformers generates from the checkpoint rounded
    through Q8_0. The blocks' kernel rounds the activations to 8 bits, as llama.cpp's does: the logprobs agree to
    2e-2, and one sequence may leave transformers' at a near-tie."""
    checkpoint = checkpoints["qwen3_moe"]
    path = write_gguf(checkpoint, tmp_path / "qwen3_moe-Q8_0.gguf", Q.Q8_0, Q.Q8_0)
    expected = hf_greedy(_rounded(checkpoint, tmp_path / "rounded", Q.Q8_0, Q.Q8_0), PROMPTS, MAX_TOKENS)
    llm = LLM(model=str(path), dtype="float32", max_model_len=MAX_POSITION, enable_prefix_caching=False,
              tensor_parallel_size=2, distributed_executor_backend="ray", enable_expert_parallel=True)
    try:
        experts = llm.llm_engine.engine_core.executor.collective_rpc(
            lambda worker: [(m.local_num_experts, m.expert_start) for m in worker.model_runner.model.modules()
                            if isinstance(m, FusedMoE)][-1])
        ours = _generate(llm)
    finally:
        llm.shutdown()
    assert experts == [(2, 0), (2, 2)]
    assert check_logprobs_close(expected, ours, path.name) <= 1
    assert _chosen_logprob_error(expected, ours) < 2e-2


def test_gpt_oss_tokenizer_from_metadata(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """GPT-OSS's files name o200k's pre-tokenizer (`gpt-4o`): raylm encodes text as the checkpoint's tokenizer does
    with transformers' GGUF split for `gpt-4o` in place of its own (capitals kept with their word, contractions,
    digits in threes). transformers' GGUF loader itself cannot read a gpt-oss file's config."""
    path = write_gguf(checkpoints["gpt_oss"], tmp_path / "gpt-oss.gguf", Q.F32, Q.F32)
    theirs = set_split_regex(AutoTokenizer.from_pretrained(checkpoints["gpt_oss"]), {"pre_tokenizer_type": "gpt-4o"})
    ours = gguf_tokenizer(path)
    for text in ("CamelCase HTTPServer don't WE'LL", "12345 x/y\n\n  end", "Hello, world! It's 2026."):
        # The split itself: the tiny vocabulary has no merge across the boundaries where the splits differ.
        split = ours.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)
        assert split == theirs.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text), text
        assert ours.encode(text) == theirs.encode(text), text
