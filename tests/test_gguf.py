"""GGUF files the test writes itself (tiny random Llama, Qwen2 and Qwen3 through the gguf package's writer, linear
weights in Q8_0 or Q4_1): the config and tokenizer read from the metadata, and greedy generation with the weights kept
packed and dequantized, each against transformers loading the same file (in float32, and at the default dtype, which
is bfloat16 on a CPU with bfloat16 dot products, in bfloat16); refusals name what they refuse."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from raylm.cluster import LLM, SamplingParams
from raylm.configs.engine_config import ModelConfig
from raylm.configs.gguf_metadata import gguf_tokenizer, read_gguf_config
from raylm.configs.model_info import cpu_bf16_instructions, cpu_multiplies_bf16, read_model_info, resolve_dtype
from scripts.gguf_to_safetensors import write_float32_checkpoint
from tests.gguf_files import write_gguf
from tests.reference import TOP_K, assert_equal_but_near_ties, check_logprobs_close, greedy_with_logits, model_greedy

Q = gguf.GGMLQuantizationType
CASES = [("llama", Q.Q4_1), ("llama", Q.Q8_0), ("qwen2", Q.Q4_1), ("qwen2", Q.Q8_0), ("qwen3", Q.Q4_1)]
TEXTS = ["The quick brown fox", "  two spaces,\nnew lines\n\n and tabs\t!", "Numbers 12345 and 3.14159 in 2100",
         "<|start|>user\nhello<|end|>", "Unicode: l'été, naïve, 日本語, emoji 🙂", "it's we'll THEY'RE"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
MAX_TOKENS = 10


def _case_id(case: tuple[str, Q]) -> str:
    return f"{case[0]}-{case[1].name}"


@pytest.fixture(scope="module", params=CASES, ids=_case_id)
def gguf_file(request: pytest.FixtureRequest, checkpoints: dict[str, Path],
              tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the HF checkpoint, the GGUF written from it)."""
    arch, qtype = request.param
    out = tmp_path_factory.mktemp("gguf") / f"{arch}-{qtype.name}.gguf"
    return checkpoints[arch], write_gguf(checkpoints[arch], out, qtype)


def hf_model(checkpoint: Path, path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    # transformers 5.25 reads no head_dim from a qwen3 GGUF (it would take 128): give it the checkpoint's config.
    config = AutoConfig.from_pretrained(checkpoint)
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config, dtype=dtype).eval()


def test_config_from_metadata(gguf_file: tuple[Path, Path]) -> None:
    checkpoint, path = gguf_file
    ours, original = read_gguf_config(path), json.loads((checkpoint / "config.json").read_text())
    original.setdefault("head_dim", original["hidden_size"] // original["num_attention_heads"])
    theirs = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
                "eos_token_id", "pad_token_id"):
        assert getattr(ours, key) == original[key], key
        if key != "head_dim":  # see hf_model
            assert getattr(ours, key) == getattr(theirs, key), key
    assert ours.architectures == original["architectures"]
    assert ours.rms_norm_eps == pytest.approx(original["rms_norm_eps"], rel=1e-6)  # stored as float32
    assert ours.rope_parameters["rope_theta"] == original["rope_parameters"]["rope_theta"]
    assert getattr(ours, "attention_bias", None) == original.get("attention_bias")


def test_tokenizer_from_metadata(gguf_file: tuple[Path, Path]) -> None:
    checkpoint, path = gguf_file
    ours = gguf_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    original = AutoTokenizer.from_pretrained(checkpoint)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text) == original.encode(text), text
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.chat_template == original.chat_template
    assert (ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
            == original.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True))
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (original.bos_token, original.eos_token,
                                                                original.pad_token)


def _prompts() -> list[list[int]]:
    return [[5, 17, 33, 400, 12], list(range(10, 70)), [300] * 3]


def _generate(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)
    outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def _hf_generate(model: torch.nn.Module) -> list[tuple[list[int], list[dict[int, float]]]]:
    return model_greedy(model, _prompts(), MAX_TOKENS)


@pytest.mark.parametrize("quantization", ["gguf", "none"])
def test_generation_matches_transformers(gguf_file: tuple[Path, Path], quantization: str) -> None:
    """In float32, kept packed (the block kernels or float32 kernels on a float32 copy) or dequantized, raylm
    generates what transformers generates in float32 from the same file; dequantized, its logprobs agree to 1e-4."""
    checkpoint, path = gguf_file
    reference = _hf_generate(hf_model(checkpoint, path))
    llm = LLM(model=str(path), quantization=quantization, dtype="float32", max_model_len=128,
              enable_prefix_caching=False)
    try:
        ours = _generate(llm)
    finally:
        llm.shutdown()
    assert check_logprobs_close(reference, ours, f"{path.name} {quantization}") == 0
    if quantization == "none":
        for (_, ref_top), (_, our_top) in zip(reference, ours):
            for ref_at, our_at in zip(ref_top, our_top):
                assert all(abs(ref_at[t] - our_at[t]) < 1e-4 for t in our_at if t in ref_at)


def test_default_dtype_follows_transformers_in_bf16(gguf_file: tuple[Path, Path]) -> None:
    """At its defaults a GGUF file computes in bfloat16 where the CPU multiplies it (resolve_dtype; elsewhere the
    test asks for bfloat16): its blocks planned against bfloat16 kernels on a bfloat16 copy. The 16-bit parity rule
    against transformers loading the same file in bfloat16: equal greedy tokens, except at a near-tie."""
    checkpoint, path = gguf_file
    prompts = [*_prompts(), list(range(100, 117)), [7]]
    assert resolve_dtype(ModelConfig(), read_model_info(str(path)), "cpu", cpu_bf16_instructions()) == (
        "bfloat16" if cpu_multiplies_bf16() else "float32")
    llm = LLM(model=str(path), dtype="auto" if cpu_multiplies_bf16() else "bfloat16", max_model_len=128,
              enable_prefix_caching=False, max_num_seqs=8)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    reference = greedy_with_logits(hf_model(checkpoint, path, torch.bfloat16), prompts, 16)
    # The parity rule per sequence. How many sequences meet a near-tie in 16 tokens of a random tiny model (flat
    # logits) depends on which kernels the machine's plan picked: the AMX kernel and oneDNN's bfloat16 copy are equally
    # exact (each within bfloat16's output rounding of a float64 product), but sum in other orders.
    assert_equal_but_near_ties(reference, [list(o.outputs[0].token_ids) for o in outputs])


def test_float32_checkpoint_written_from_gguf(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """scripts/gguf_to_safetensors.py: the folder it writes (the float32 twin, for engines without GGUF) tokenizes as
    the file does, and raylm on it generates what transformers generates from the file, logprobs within 1e-4."""
    path = write_gguf(checkpoints["llama"], tmp_path / "llama-Q4_1.gguf", Q.Q4_1)
    folder = write_float32_checkpoint(path, tmp_path / "f32")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert all(tokenizer.encode(text) == gguf_tokenizer(path).encode(text) for text in TEXTS)
    assert tokenizer.chat_template == gguf_tokenizer(path).chat_template
    llm = LLM(model=str(folder), max_model_len=128, enable_prefix_caching=False)
    try:
        ours = _generate(llm)
    finally:
        llm.shutdown()
    reference = _hf_generate(hf_model(checkpoints["llama"], path))
    assert check_logprobs_close(reference, ours, "f32 folder") == 0
    for (_, ref_top), (_, our_top) in zip(reference, ours):
        for ref_at, our_at in zip(ref_top, our_top):
            assert all(abs(ref_at[t] - our_at[t]) < 1e-4 for t in our_at if t in ref_at)


def test_unsupported_tensor_type_is_refused_by_name(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Q5_0 has no raylm kernel: kept packed it is refused with its name; dequantized (`none`) it loads and matches
    transformers."""
    path = write_gguf(checkpoints["qwen2"], tmp_path / "qwen2-Q5_0.gguf", Q.Q5_0)
    with pytest.raises(ValueError, match=r"blk\.0\.\w+\.weight \(Q5_0\) has no raylm kernel"):
        LLM(model=str(path), max_model_len=128)
    llm = LLM(model=str(path), quantization="none", max_model_len=128, enable_prefix_caching=False)
    try:
        ours = _generate(llm)
    finally:
        llm.shutdown()
    assert check_logprobs_close(_hf_generate(hf_model(checkpoints["qwen2"], path)), ours, "Q5_0 none") == 0


def test_unsupported_architecture_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="GGUF architecture 'falcon' is not supported"):
        read_gguf_config(path)


def test_gguf_quantization_needs_a_gguf_file(checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="'gguf' keeps a GGUF file's own formats"):
        LLM(model=str(checkpoints["llama"]), quantization="gguf")
