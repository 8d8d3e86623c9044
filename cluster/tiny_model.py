"""Build a tiny, randomly initialised causal-LM checkpoint in the Hugging Face layout, fully offline.

The checkpoint (config, safetensors weights, generation config, byte-level BPE tokenizer with a chat
template) is deterministic for a given seed, so tests and examples can rely on it without any download.

    python scripts/make_tiny_model.py --out models/tiny-llama --arch llama   (built on demand by the engine)
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import math
import os
import random
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "models" / "tiny-llama"
ARCHS = ("llama", "qwen2", "qwen3")
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")

BOS, EOS, PAD, START, END = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|start|>", "<|end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, START, END]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start|>' + message['role'] + '\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start|>assistant\\n' }}{% endif %}"
)

_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

LLAMA3_ROPE_SCALING: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}

_NOUNS = """time year people way day man woman child world life hand part place case week company system
program question work government number night point home water room mother area money story fact month lot
right study book eye job word business issue side kind head house service friend father power hour game line
end member law car city community name president team minute idea kid body information back parent face
others level office door health person art war history party result change morning reason research girl guy
moment air teacher force education river garden road window paper music table market forest bridge train
ship island mountain letter kitchen dog cat bird horse tree flower stone song doctor student village castle
machine engine signal message answer language network server model token cloud storm winter summer"""
_VERBS = """saw found made took gave told felt left kept began seemed helped showed heard played ran moved
lived believed brought wrote sat stood lost paid met included continued learned changed led understood
watched followed stopped created spoke read spent grew opened walked won offered remembered loved considered
appeared bought waited served died sent expected built stayed fell reached killed remained suggested raised
passed sold required reported decided pulled carried painted crossed visited answered counted cleaned"""
_ADJS = """good new first last long great little own other old right big high different small large next early
young important few public bad same able red blue green quiet bright dark warm cold happy sad strange simple
careful gentle heavy light rapid slow ancient modern hidden broken golden silver wooden empty full busy calm"""
_ADVS = "quickly slowly quietly often never always soon today yesterday together again already almost rather"
_PREPS = "in on at by with from into over under near behind across through after before during without toward"
_DETS = "the a this that every some no one another each my your his her our their"
_SYLLABLES = "ka lo mi ra ne to su vi da per gal tor en an is or bel dor mar lin fen rik sha thu wex zor qua".split()


def _corpus(seed: int, n_chars: int = 300_000) -> list[str]:
    """Seeded English-like sentences (plus invented names and numbers so BPE has enough merges to learn)."""
    rng = random.Random(seed)
    nouns, verbs, adjs = _NOUNS.split(), _VERBS.split(), _ADJS.split()
    advs, preps, dets = _ADVS.split(), _PREPS.split(), _DETS.split()
    names = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))).capitalize() for _ in range(400)]

    def phrase() -> str:
        words = [rng.choice(dets)]
        if rng.random() < 0.6:
            words.append(rng.choice(adjs))
        words.append(rng.choice(nouns) + ("s" if rng.random() < 0.25 else ""))
        return " ".join(words)

    lines: list[str] = []
    total = 0
    while total < n_chars:
        subject = rng.choice(names) if rng.random() < 0.3 else phrase()
        parts = [subject, rng.choice(verbs), phrase(), rng.choice(preps), phrase()]
        if rng.random() < 0.3:
            parts.insert(2, rng.choice(advs))
        if rng.random() < 0.25:
            parts += ["in", str(rng.randint(1, 2100))]
        sentence = " ".join(parts)
        sentence = sentence[0].upper() + sentence[1:]
        kind = rng.random()
        if kind < 0.1:
            sentence = f'"{sentence}?" asked {rng.choice(names)}.'
        elif kind < 0.3:
            sentence += f", and {phrase()} {rng.choice(verbs)} {rng.choice(advs)}."
        else:
            sentence += "."
        lines.append(sentence)
        total += len(sentence) + 1
    return lines


@functools.lru_cache(maxsize=8)
def _train_tokenizer_json(vocab_size: int, seed: int) -> str:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    # transformers 5 rebuilds the normalizer/pre-tokenizer of any qwen2 checkpoint as Qwen2Tokenizer does, so use
    # exactly those (NFC, Qwen split regex, ByteLevel): tokenizer.json and AutoTokenizer then agree for every arch.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Llama-3 style: encode() prepends bos; apply_chat_template tokenizes without special tokens, so no doubling.
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    return tok.to_str()


def build_tokenizer(vocab_size: int = 2048, seed: int = 0) -> Any:
    """A PreTrainedTokenizerFast around a freshly trained (cached) byte-level BPE."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_train_tokenizer_json(vocab_size, seed)),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[START, END],
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _rope_kwargs(config_cls: type, rope_theta: float, rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    # transformers 5 folds rope_theta and the scaling dict into `rope_parameters`; 4.x takes them separately.
    if "rope_parameters" in inspect.signature(config_cls.__init__).parameters:
        return {"rope_parameters": {"rope_type": "default", **(rope_scaling or {}), "rope_theta": rope_theta}}
    return {"rope_theta": rope_theta, **({"rope_scaling": dict(rope_scaling)} if rope_scaling else {})}


def make_tiny_model(
    out: Path | str | None = None,
    *,
    arch: str = "llama",
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 384,
    vocab_size: int = 2048,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    tie_word_embeddings: bool | None = None,
    rope_scaling: str | dict[str, Any] | None = None,
    force: bool = False,
) -> Path:
    """Write the checkpoint to `out` (default models/tiny-llama) and return it; reuse an existing one unless force.

    tie_word_embeddings=None means the arch's usual choice: untied for llama, tied for qwen2/qwen3.
    rope_scaling may be "llama3" (Llama-3.1 style scaling) or an explicit rope-scaling dict.
    """
    out = Path(out) if out is not None else DEFAULT_OUT
    if all((out / name).is_file() for name in REQUIRED_FILES) and not force:
        return out
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, Qwen2Config, Qwen3Config

    if rope_scaling == "llama3":
        rope_scaling = LLAMA3_ROPE_SCALING
    elif isinstance(rope_scaling, str):
        raise ValueError(f"unknown rope scaling {rope_scaling!r}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
    head_dim = hidden_size // num_heads
    if arch == "llama":
        cls, theta, extra, tie = LlamaConfig, 500_000.0, {"head_dim": head_dim, "attention_bias": False}, False
    elif arch == "qwen2":  # Qwen2 attention always has q/k/v bias
        cls, theta, extra, tie = Qwen2Config, 1_000_000.0, {"use_sliding_window": False}, True
    elif arch == "qwen3":  # Qwen3 adds per-head q/k RMSNorm; head_dim must be explicit (its default is 128)
        cls, theta, extra, tie = Qwen3Config, 1_000_000.0, {"head_dim": head_dim, "attention_bias": False}, True
    else:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")

    tokenizer = build_tokenizer(vocab_size, seed)
    ids = {f"{t}_token_id": getattr(tokenizer, f"{t}_token_id") for t in ("bos", "eos", "pad")}
    config = cls(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie if tie_word_embeddings is None else tie_word_embeddings,
        **ids,
        **extra,
        **_rope_kwargs(cls, theta, rope_scaling),
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Stop both at end-of-text and at the end of a chat turn.
    stop_ids = [ids["eos_token_id"], tokenizer.convert_tokens_to_ids(END)]
    model.generation_config = GenerationConfig(**{**ids, "eos_token_id": stop_ids})
    _write_atomically(out, model, tokenizer)
    return out


def _write_atomically(out: Path, model: Any, tokenizer: Any) -> None:
    """Save into a sibling temp folder, then swap it in by rename: an interrupted run never leaves a half checkpoint."""
    from transformers.utils import logging as hf_logging

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    old = tmp.with_name(tmp.name + ".old")
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        tmp.mkdir()
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        # Without an explicit null, transformers 5 loads qwen2 checkpoints via Qwen2Tokenizer, which then invents an
        # unk token "<|endoftext|>" with an id past the model's vocab.
        tok_cfg_path = tmp / "tokenizer_config.json"
        tok_cfg = json.loads(tok_cfg_path.read_text())
        tok_cfg["unk_token"] = None
        tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")
        # save_pretrained writes some files owner-only; make the checkpoint readable like any other file we create.
        umask = os.umask(0)
        os.umask(umask)
        for f in tmp.iterdir():
            f.chmod(0o666 & ~umask)
        if out.exists():
            out.rename(old)
        tmp.rename(out)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def count_parameters(path: Path | str) -> int:
    from safetensors import safe_open

    with safe_open(str(Path(path) / "model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: models/tiny-llama)")
    p.add_argument("--arch", choices=ARCHS, default="llama")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=384)
    p.add_argument("--vocab-size", type=int, default=2048, help="target BPE vocab size")
    p.add_argument("--max-position-embeddings", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tie-word-embeddings", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--rope-scaling", choices=["llama3"], default=None)
    p.add_argument("--force", action="store_true", help="rebuild even if a checkpoint is already there")

    start = time.perf_counter()
    out = make_tiny_model(**vars(p.parse_args(argv)))
    print(f"{out}  ({count_parameters(out):,} parameters, {time.perf_counter() - start:.2f}s)")
