"""GGUF files of the families beyond Llama's shape (Gemma 2, Gemma 3, Phi-3), written by the test from tiny random
checkpoints as llama.cpp's converter writes them (tests/gguf_files.py): the config read from the metadata against the
checkpoint's own (windows, layer pattern, soft-caps, rope bases, LongRoPE), and greedy generation in float32, float and
block-quantized, against transformers loading the same file. Architectures raylm does not run are refused by name
before anything loads."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.models.tiny_model import make_tiny_model
from raylm.configs.gguf_metadata import read_gguf_config
from tests.gguf_files import write_gguf
from tests.reference import TOP_K, check_logprobs_close, hf_greedy, model_greedy
from tests.rope_checkpoints import with_config

Q = gguf.GGMLQuantizationType
MAX_POSITION = 128
# Each family's tiny checkpoint: windows (8) shorter than the prompts, Gemma 2 with both soft-caps, Gemma 3 with
# sliding and global layers alternating, a final cap and linear rope scaling on the global layers (as Gemma 3 4B and
# up), Phi-3 with LongRoPE on half of each head.
FAMILIES = {
    "gemma2": dict(arch="gemma2", sliding_window=8, attn_logit_softcapping=1.0, final_logit_softcapping=30.0),
    "gemma3": dict(arch="gemma3", num_layers=4, sliding_window=8, sliding_window_pattern=2,
                   final_logit_softcapping=30.0),
    "phi3": dict(arch="phi3", rope_scaling="longrope", partial_rotary_factor=0.5, original_max_position_embeddings=32),
}
CASES = [("gemma2", Q.F16), ("gemma2", Q.Q8_0), ("gemma3", Q.F32), ("gemma3", Q.Q4_0), ("phi3", Q.F16),
         ("phi3", Q.Q8_0)]
# Longer than the windows, and than Phi-3's original context (32), past which both rotate with the long factors.
PROMPTS = [list(range(40, 74)), [7, 300, 12, 5] * 12]
MAX_TOKENS = 8
Result = list[tuple[list[int], list[dict[int, float]]]]


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    built = {name: make_tiny_model(root / f"{name}-base", vocab_size=512, max_position_embeddings=MAX_POSITION,
                                   **settings) for name, settings in FAMILIES.items()}
    return {**built, "gemma3": with_config(built["gemma3"], root / "gemma3", rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}})}


@pytest.fixture(scope="module", params=CASES, ids=lambda case: f"{case[0]}-{case[1].name}")
def gguf_file(request: pytest.FixtureRequest, family_checkpoints: dict[str, Path],
              tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the HF checkpoint, the GGUF written from it; embeddings in the linears' type)."""
    family, qtype = request.param
    out = tmp_path_factory.mktemp("gguf") / f"{family}-{qtype.name}.gguf"
    return family_checkpoints[family], write_gguf(family_checkpoints[family], out, qtype, embedding_type=qtype)


def test_config_from_metadata(gguf_file: tuple[Path, Path]) -> None:
    checkpoint, path = gguf_file
    ours, original = read_gguf_config(path).to_dict(), json.loads((checkpoint / "config.json").read_text())
    assert ours["architectures"] == original["architectures"] and ours["model_type"] == original["model_type"]
    for key in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                "tie_word_embeddings", "sliding_window", "layer_types", "query_pre_attn_scalar",
                "attn_logit_softcapping", "final_logit_softcapping", "partial_rotary_factor",
                "original_max_position_embeddings", "hidden_activation"):
        assert ours.get(key) == original.get(key), key
    ours_rope, original_rope = ours["rope_parameters"], original["rope_parameters"]
    if "long_factor" in original_rope:  # stored as float32 tensors
        for key in ("long_factor", "short_factor"):
            assert ours_rope.pop(key) == pytest.approx(original_rope.pop(key), rel=1e-6), key
        ours_rope.pop("attention_factor")  # llama.cpp's converter stores the value transformers computes
    assert ours_rope == original_rope


def test_generation_matches_transformers(gguf_file: tuple[Path, Path]) -> None:
    """raylm in float32, the file's blocks kept packed, generates what transformers generates in float32 from the same
    file (Gemma's norms with their folded one taken off, Phi-3's fused qkv / gate_up split by the loaders). transformers
    reads none of the family settings from a GGUF, so it gets the checkpoint's config."""
    checkpoint, path = gguf_file
    assert check_logprobs_close(_transformers(checkpoint, path), _raylm(path), path.name) == 0


@torch.inference_mode()
def _transformers(checkpoint: Path, path: Path) -> Result:
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 config=AutoConfig.from_pretrained(checkpoint)).eval()
    return model_greedy(model, PROMPTS, MAX_TOKENS)


def _raylm(path: Path) -> Result:
    llm = LLM(model=str(path), dtype="float32", max_model_len=MAX_POSITION, enable_prefix_caching=False)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                               SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K),
                               use_tqdm=False)
    finally:
        llm.shutdown()
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs]


def test_mistral_file_runs_as_llama_with_the_hf_tokenizer(tmp_path: Path) -> None:
    """A Mistral checkpoint (no window, as from v0.2 on) converts, as llama.cpp converts it, to a llama file with a
    SentencePiece vocabulary (`llama`, as Gemma's and Phi-3's files have too), which raylm does not rebuild: the engine
    refuses the vocabulary by name, and with `tokenizer=` the Hugging Face tokenizer runs the file as Llama, generating
    what transformers' Mistral generates from the checkpoint (the file in float32: the same weights)."""
    checkpoint = make_tiny_model(tmp_path / "mistral", arch="mistral", vocab_size=512,
                                 max_position_embeddings=MAX_POSITION)
    path = write_gguf(checkpoint, tmp_path / "mistral-F32.gguf", Q.F32, Q.F32, tokenizer_model="llama")
    assert read_gguf_config(path).architectures == ["LlamaForCausalLM"]
    with pytest.raises(ValueError, match="tokenizer model 'llama' is not supported .* pass tokenizer="):
        LLM(model=str(path), max_model_len=MAX_POSITION)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    llm = LLM(model=str(path), tokenizer=str(checkpoint), dtype="float32", max_model_len=MAX_POSITION)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K), use_tqdm=False)
        # Text in, through the HF tokenizer (BOS and all), as a served request comes.
        text = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    finally:
        llm.shutdown()
    ours = [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs]
    assert check_logprobs_close(hf_greedy(checkpoint, PROMPTS, MAX_TOKENS), ours, path.name) == 0
    for o in outputs:  # the detokenizer holds back an unfinished UTF-8 sequence at the end
        expected = tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True)
        assert o.outputs[0].text.rstrip("\ufffd") == expected.rstrip("\ufffd")
    assert text.prompt_token_ids == tokenizer.encode("The quick brown fox")


def test_unsupported_architecture_is_refused_by_name(tmp_path: Path) -> None:
    """A Qwen2-MoE GGUF (shared experts with their own gate) is refused from its metadata, before the engine reads a
    tensor."""
    path = tmp_path / "qwen2moe.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2moe")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="GGUF architecture 'qwen2moe' is not supported; raylm runs GGUF files of "
                                         "llama, qwen2, qwen3, gemma2, gemma3, phi3"):
        LLM(model=str(path), max_model_len=128)
