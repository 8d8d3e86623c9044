"""GGUF files written by the tests themselves, from the tiny random checkpoints, through the `gguf` package's writer:
llama.cpp's metadata keys and tensor names, its q/k row order for the llama architecture, Gemma's norms with their
one folded in and Phi-3's LongRoPE factors as tensors (as llama.cpp's converter writes them), the MoE families' experts
stacked per layer and their own keys (tests/gguf_moe_files.py), the tokenizer as metadata, and the linear weights
quantized to the type asked for."""
from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

from raylm.cluster.models.tiny_tokenizer import SPECIAL_TOKENS
from tests.gguf_moe_files import MOE_ARCHS, ROUTERS, add_moe, moe_tensors

# Mistral's checkpoints convert as llama files (llama.cpp has no mistral architecture for them).
ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
         "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
         "Phi3ForCausalLM": "phi3", **MOE_ARCHS}
PRE_TOKENIZERS = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2", "gemma2": "llama-bpe",
                  "gemma3": "llama-bpe", "phi3": "llama-bpe", "qwen3moe": "qwen2", "deepseek2": "llama-bpe",
                  "gpt-oss": "gpt-4o"}


def _llama_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter order of q/k rows (each head's two rotary halves interleaved)."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2) \
        .reshape(weight.shape)


def write_gguf(checkpoint: Path, out: Path, linear_type: gguf.GGMLQuantizationType,
               embedding_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q8_0,
               tokenizer_model: str = "gpt2", expert_type: gguf.GGMLQuantizationType | None = None,
               split_kv_b: bool = True) -> Path:
    """`checkpoint` (an HF folder from make_tiny_model) as a GGUF file at `out`; `tokenizer_model` the vocabulary
    kind it declares (the vocabulary itself stays the checkpoint's byte-level BPE); `expert_type` the MoE experts'
    type (None: linear_type's; routers stay float32, as llama.cpp's converter keeps them); `split_kv_b` False writes
    DeepSeek's MLA as llama.cpp did before it split kv_b into k_b and v_b."""
    config = json.loads((checkpoint / "config.json").read_text())
    arch = ARCHS[config["architectures"][0]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3's per-layer-kind parameters: the file's are the global ones
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(rope.get("rope_theta") or config.get("rope_theta") or 10000.0)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(int(head_dim * config.get("partial_rotary_factor", 1.0)))
    if arch in ("gemma2", "gemma3"):
        _add_gemma(writer, config)
    elif arch == "phi3":
        _add_phi3(writer, config, rope)
    if config["architectures"][0] in MOE_ARCHS:
        add_moe(writer, config, arch, rope, split_kv_b)
    _add_tokenizer(writer, checkpoint, PRE_TOKENIZERS[arch], tokenizer_model)
    tensor_map = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                          config["num_hidden_layers"])
    for name, weight in moe_tensors(load_file(checkpoint / "model.safetensors"), config, split_kv_b).items():
        gguf_name = tensor_map.get_name(name, try_suffixes=(".weight", ".bias"))
        weight = weight.astype(np.float32)
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            weight = _llama_permute(weight, heads if ".q_proj." in name else kv_heads)
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            weight = weight + 1
        qtype = gguf.GGMLQuantizationType.F32
        if weight.ndim >= 2 and not name.endswith(".bias") and not name.endswith(ROUTERS):
            qtype = embedding_type if "embed_tokens" in name or name.startswith("lm_head") else linear_type
            qtype = expert_type or qtype if ".experts." in name else qtype
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, weight)
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(gguf_name, weight.astype(np.float16))
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(weight, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_gemma(writer: gguf.GGUFWriter, config: dict) -> None:
    """Gemma's window, its layer pattern (one bool per layer, true: sliding) and soft-caps; llama.cpp's converter
    leaves the scale out (it is head_dim but for the 27B models) and the local rope base (10k) too."""
    writer.add_sliding_window(config["sliding_window"])
    writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config["layer_types"]])
    if config.get("attn_logit_softcapping") and config["architectures"][0] == "Gemma2ForCausalLM":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])


def _add_phi3(writer: gguf.GGUFWriter, config: dict, rope: dict) -> None:
    """Phi-3's original context and, for LongRoPE, its factors as the tensors rope_factors_long / _short with the
    attention factor llama.cpp's converter computes."""
    original = config["original_max_position_embeddings"]
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_sliding_window(config.get("sliding_window") or 0)
    if rope.get("rope_type") == "longrope":
        scale = config["max_position_embeddings"] / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))


def _add_tokenizer(writer: gguf.GGUFWriter, checkpoint: Path, pre: str, model: str) -> None:
    tokenizer = json.loads((checkpoint / "tokenizer.json").read_text())
    vocab = dict(tokenizer["model"]["vocab"])
    for added in tokenizer["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    tokenizer_config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    writer.add_bos_token_id(vocab[tokenizer_config["bos_token"]])
    writer.add_eos_token_id(vocab[tokenizer_config["eos_token"]])
    writer.add_pad_token_id(vocab[tokenizer_config["pad_token"]])
    writer.add_add_bos_token(True)
    template = checkpoint / "chat_template.jinja"
    writer.add_chat_template(template.read_text() if template.exists() else tokenizer_config["chat_template"])
