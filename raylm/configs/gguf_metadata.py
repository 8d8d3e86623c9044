"""A GGUF file's metadata as a Hugging Face config and fast tokenizer, read with the `gguf` package.

llama.cpp keeps no config.json or tokenizer.json: shapes, rope settings, norms and the whole BPE vocabulary (tokens,
merges, token types, special ids, chat template) live as key/value metadata in the file itself. `read_gguf_config` and
`gguf_tokenizer` rebuild the config and tokenizer transformers would load from the original checkpoint; both read
metadata only (the tensors stay memory-mapped, unread) and are pure functions of the file.

Supported: architectures llama (Mistral's files too: llama.cpp converts them as llama), qwen2, qwen3, gemma2, gemma3
and phi3 (their own settings: configs.gguf_families), and the MoE families: Mixtral (a llama file with experts),
qwen3moe, deepseek2 (DeepSeek V2 / V3) and gpt-oss (configs.gguf_moe); byte-level BPE vocabularies
(`tokenizer.ggml.model` gpt2) with the pre-tokenizer splits below. Anything else is refused with the name found in
the file.
"""
from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raylm.configs.gguf_families import MODEL_TYPES, family_settings
from raylm.configs.gguf_moe import is_moe_file, moe_settings

if TYPE_CHECKING:
    from gguf import GGUFReader
    from transformers import PretrainedConfig, PreTrainedTokenizerBase, PreTrainedTokenizerFast

# general.architecture -> the Hugging Face class raylm runs it as
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
                 "qwen3moe": "Qwen3MoeForCausalLM", "deepseek2": "DeepseekV2ForCausalLM",
                 "gpt-oss": "GptOssForCausalLM"}

# tokenizer.ggml.pre -> the regex that splits text before byte-level BPE (llama.cpp's, per vocabulary); None: GPT-2's
# own split inside the ByteLevel pre-tokenizer.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k's split (GPT-OSS): a word keeps its leading capitals and trailing contraction, digits go in threes.
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (), "gpt2": (),
    "smollm": (r"\p{N}", _GPT2_SPLIT),  # every digit alone, then GPT-2's split
    "llama-bpe": (_LLAMA3_SPLIT,), "llama3": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "gpt-4o": (_GPT4O_SPLIT,),
}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values
_LIST_KEYS = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"}


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf") and Path(path).is_file()


@lru_cache(maxsize=2)
def gguf_reader(path: str) -> GGUFReader:
    """One parse of the file per process (gguf's reader walks every metadata string eagerly: seconds for a 49K-token
    vocabulary); the tensors stay memory-mapped."""
    from gguf import GGUFReader

    return GGUFReader(path)


@lru_cache(maxsize=2)
def read_gguf_metadata(path: str) -> tuple[dict[str, Any], frozenset[str]]:
    """({key: value} for every metadata field, the file's tensor names). Long arrays are read only for the tokenizer
    keys."""
    reader = gguf_reader(path)
    metadata = {key: field.contents() for key, field in reader.fields.items()
                if not key.startswith("GGUF.") and (key in _LIST_KEYS or len(field.data) < 4096)}
    return metadata, frozenset(tensor.name for tensor in reader.tensors)


def gguf_architecture(metadata: dict[str, Any]) -> str:
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; raylm runs GGUF files of "
                         f"{', '.join(ARCHITECTURES)} (load other models from their Hugging Face checkpoint)")
    return arch


def read_gguf_config(path: str | Path) -> PretrainedConfig:
    """The transformers config of the model a GGUF file holds (LlamaConfig, Qwen2Config, Gemma2Config, ...)."""
    from transformers import AutoConfig

    metadata, tensors = read_gguf_metadata(str(path))
    arch = gguf_architecture(metadata)

    def get(key: str, default: Any = ...) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is ...:
            raise ValueError(f"GGUF file {path} lacks the metadata key {arch}.{key}")
        return value

    hidden, heads = int(get("embedding_length")), _one_value(get("attention.head_count"), "attention.head_count")
    kv_heads = _one_value(get("attention.head_count_kv", heads), "attention.head_count_kv")
    head_dim = int(get("attention.key_length", hidden // heads))
    # DeepSeek's MLA keeps keys and values of other sizes (configs.gguf_moe reads them).
    if arch != "deepseek2" and int(get("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"GGUF file {path}: value heads of another size than key heads are not supported")
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    settings: dict[str, Any] = dict(
        architectures=[ARCHITECTURES[arch]],
        vocab_size=int(get("vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(get("context_length")),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in tensors,
        **_special_token_ids(metadata),
    )
    if arch != "qwen2":  # Qwen2 always has q/k/v biases; Llama and Qwen3 say so in their config
        settings["attention_bias"] = "blk.0.attn_q.bias" in tensors
    rope_theta, rope_scaling = float(get("rope.freq_base", 10000.0)), _rope_scaling(get, path, tensors, head_dim)
    rope = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": rope_theta}
    if is_moe_file(arch, get):
        settings.update(moe_settings(arch, get, tensors, rope))
    else:
        settings.update(family_settings(arch, get, lambda name: _tensor_values(path, name), tensors, rope, head_dim))
    return AutoConfig.for_model(settings.pop("model_type", MODEL_TYPES.get(arch, arch)), **settings)


def _tensor_values(path: str | Path, name: str) -> list[float]:
    tensor = next(t for t in gguf_reader(str(path)).tensors if t.name == name)
    return [float(x) for x in tensor.data.reshape(-1)]


def _one_value(value: Any, key: str) -> int:
    """A per-layer array (some files store head counts per layer) must hold one value throughout."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"GGUF {key} differs between layers ({sorted(set(value))}); not supported")
        value = value[0]
    return int(value)


def _special_token_ids(metadata: dict[str, Any]) -> dict[str, Any]:
    ids: dict[str, Any] = {}
    for name, key in (("bos_token_id", "bos"), ("pad_token_id", "padding")):
        if f"tokenizer.ggml.{key}_token_id" in metadata:
            ids[name] = int(metadata[f"tokenizer.ggml.{key}_token_id"])
    # A chat model ends its turn with an end-of-turn token that may differ from eos: generation stops at either.
    eos = sorted({int(metadata[f"tokenizer.ggml.{key}_token_id"]) for key in ("eos", "eot", "eom")
                  if f"tokenizer.ggml.{key}_token_id" in metadata})
    if eos:
        ids["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return ids


def _rope_scaling(get: Any, path: str | Path, tensors: frozenset[str], head_dim: int) -> dict[str, Any] | None:
    scaling_type = get("rope.scaling.type", "none")
    if "rope_freqs.weight" in tensors:
        # llama.cpp stores Llama 3.1's scaling as per-frequency factors; raylm rebuilds them from rope_parameters.
        return _llama3_scaling(path, get("rope.freq_base", 10000.0), head_dim)
    if scaling_type == "none":
        return None
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    if scaling_type == "yarn":
        return {"rope_type": "yarn", "factor": float(get("rope.scaling.factor")),
                "original_max_position_embeddings": int(get("rope.scaling.original_context_length"))}
    raise ValueError(f"GGUF file {path}: rope scaling type {scaling_type!r} is not supported")


def _llama3_scaling(path: str | Path, base: float, head_dim: int) -> dict[str, Any]:
    """Llama 3's rope scaling whose factors equal the file's `rope_freqs` tensor (Llama 3.1 and 3.2 publish low 1,
    high 4, original context 8192, and a factor of 8 or 32), or a refusal."""
    import numpy as np

    tensor = next(t for t in gguf_reader(str(path)).tensors if t.name == "rope_freqs.weight")
    factors = np.asarray(tensor.data, dtype=np.float64).reshape(-1)
    scaling: dict[str, Any] = {"rope_type": "llama3", "factor": float(factors.max()), "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    expected: list[float] = []
    for i in range(head_dim // 2):
        wavelen = 2 * math.pi * base ** (2 * i / head_dim)
        smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
        expected.append(1.0 if wavelen < 8192 / 4.0 else scaling["factor"] if wavelen > 8192 / 1.0
                        else 1 / ((1 - smooth) / scaling["factor"] + smooth))
    if len(expected) != len(factors) or not np.allclose(factors, expected, rtol=1e-4):
        raise ValueError(f"GGUF file {path}: its rope_freqs factors match no Llama 3 rope scaling raylm knows")
    return scaling


def gguf_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """The fast tokenizer a GGUF file describes: its byte-level BPE vocabulary and merges, the pre-tokenizer split
    its `tokenizer.ggml.pre` names, control tokens as special tokens, its BOS rule and chat template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    metadata, _ = read_gguf_metadata(str(path))
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF file {path}: tokenizer model {kind!r} is not supported (raylm reads byte-level BPE, "
                         "'gpt2'); pass tokenizer= the model's Hugging Face tokenizer folder or hub id")
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise ValueError(f"GGUF file {path}: pre-tokenizer {pre!r} is not supported; supported: "
                         f"{', '.join(PRE_TOKENIZER_SPLITS)}; pass tokenizer= the model's Hugging Face tokenizer "
                         "folder or hub id")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    if not metadata.get("tokenizer.ggml.merges"):
        raise ValueError(f"GGUF file {path}: its byte-level BPE vocabulary comes without merges")
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges))
    splits = [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in PRE_TOKENIZER_SPLITS[pre]]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not splits)])
    tokenizer.decoder = decoders.ByteLevel()
    types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types) if kind == _CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, types) if kind == _USER_DEFINED])
    ids = _special_token_ids(metadata)
    post: list[processors.PostProcessor] = [processors.ByteLevel(trim_offsets=False)]
    bos_id = ids.get("bos_token_id")
    if metadata.get("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[bos_id]
        post.append(processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                                  special_tokens=[(bos, bos_id)]))
    tokenizer.post_processor = processors.Sequence(post)
    special = {name: tokens[metadata[f"tokenizer.ggml.{key}_token_id"]]
               for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                                 ("pad_token", "padding")) if f"tokenizer.ggml.{key}_token_id" in metadata}
    # transformers leaves its tokenizer constructors unannotated.
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer, chat_template=metadata.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False, **special)


def get_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a checkpoint: a GGUF file's own, else AutoTokenizer's for a folder or hub id."""
    if is_gguf(path):
        return gguf_tokenizer(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
