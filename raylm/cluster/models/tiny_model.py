"""Build a tiny, randomly initialised causal-LM checkpoint in the Hugging Face layout, fully offline.

The checkpoint (config, safetensors weights, generation config, byte-level BPE tokenizer with a chat
template) is deterministic for a given seed, so tests and examples can rely on it without any download.
Without a folder to write to, it is built once per machine into the user cache (~/.cache/raylm/models/<key>, see
configs.envs), keyed by its settings and the code that writes it; that is where the engine's default model lives.

    python scripts/make_tiny_model.py [--out DIR] [--arch llama]   (the default is built on demand by the engine)
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import tokenizers
import torch
import transformers

from raylm.cluster.models.tiny_tokenizer import END, _train_tokenizer_json, build_tokenizer
from raylm.configs.cache import build_once, cache_path, content_key

DEFAULT_MODEL_NAME = "tiny-llama"
ARCHS = ("llama", "qwen2", "qwen3", "mixtral", "qwen3_moe", "phi3", "mistral", "gemma2", "gemma3")
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")
# What the checkpoint's bytes depend on besides the settings: the code that writes it and the libraries it calls.
_GENERATOR_SOURCES = (Path(__file__), Path(__file__).with_name("tiny_tokenizer.py"))
# The tokenizer helpers moved to cluster.models.tiny_tokenizer; re-exported for callers that import them from here.
__all__ = ["ARCHS", "DEFAULT_MODEL_NAME", "_train_tokenizer_json", "build_tokenizer", "count_parameters", "main",
           "make_tiny_model"]

LLAMA3_ROPE_SCALING: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


def _rope_kwargs(config_cls: type[transformers.PretrainedConfig], rope_theta: float,
                 rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    # transformers 5 folds rope_theta and the scaling dict into `rope_parameters`; 4.x takes them separately.
    if "rope_parameters" in inspect.signature(config_cls.__init__).parameters:
        return {"rope_parameters": {"rope_type": "default", **(rope_scaling or {}), "rope_theta": rope_theta}}
    return {"rope_theta": rope_theta, **({"rope_scaling": dict(rope_scaling)} if rope_scaling else {})}


def _longrope_scaling(rotary_dim: int, original_max_position_embeddings: int, seed: int) -> dict[str, Any]:
    """Phi-3's LongRoPE: a factor per frequency, the short set near 1 and the long one up to 8, drawn from the seed."""
    draw = torch.Generator().manual_seed(seed)
    short, long = (1 + spread * torch.rand(rotary_dim // 2, generator=draw) for spread in (0.5, 7.0))
    return {"rope_type": "longrope", "short_factor": [round(x, 4) for x in short.tolist()],
            "long_factor": [round(x, 4) for x in long.sort().values.tolist()],
            "original_max_position_embeddings": original_max_position_embeddings}


def _gemma3_rope(global_theta: float) -> dict[str, Any]:
    # Gemma 3 rotates its sliding layers with base 10k and its global ones with `global_theta`, per layer kind.
    return {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                "full_attention": {"rope_type": "default", "rope_theta": global_theta}}}


def make_tiny_model(out: Path | str | None = None, *, force: bool = False, **settings: Any) -> Path:
    """Write the checkpoint (settings: see write_tiny_model) to `out` and return it, reusing an existing one unless
    force. Without `out`, return the copy in the user cache, built there first if this machine has none."""
    if out is None:
        defaults = {name: param.default for name, param in inspect.signature(write_tiny_model).parameters.items()
                    if param.kind is inspect.Parameter.KEYWORD_ONLY}
        folder = cache_path("models", content_key(
            json.dumps({**defaults, **settings}, sort_keys=True), *(path.read_bytes() for path in _GENERATOR_SOURCES),
            torch.__version__, transformers.__version__, tokenizers.__version__))
        name = f"tiny-{settings.get('arch', 'llama').replace('_', '-')}"
        build_once(folder, lambda tmp: write_tiny_model(tmp / name, **settings),
                   f"raylm: building the tiny model {name} (once per machine, ~10 s)...")
        return folder / name
    out = Path(out)
    if all((out / name).is_file() for name in REQUIRED_FILES) and not force:
        return out
    return write_tiny_model(out, **settings)


def write_tiny_model(
    out: Path,
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
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int | None = None,
    mlp_only_layers: list[int] | None = None,
    norm_topk_prob: bool = True,
    partial_rotary_factor: float = 1.0,
    original_max_position_embeddings: int | None = None,
    sliding_window: int | None = None,
    sliding_window_pattern: int | None = None,
    attn_logit_softcapping: float | None = None,
    final_logit_softcapping: float | None = None,
) -> Path:
    """Write the checkpoint to `out`, replacing what is there, and return it.

    tie_word_embeddings=None means the arch's usual choice: untied for llama/mixtral/qwen3_moe, tied for qwen2/qwen3.
    rope_scaling may be "llama3" (Llama-3.1 style scaling), "longrope" (Phi-3's, seeded short and long factors over
    original_max_position_embeddings, None: a quarter of max_position_embeddings) or an explicit rope-scaling dict.
    Phi-3 only: partial_rotary_factor, the share of each head that rotates.
    Mistral and Gemma: sliding_window, the window of the sliding layers (None: none for Mistral, 4096 for Gemma); Gemma
    only: every sliding_window_pattern-th layer is global (None: Gemma 2's 2, Gemma 3's 6), and the soft-caps of the
    attention scores (Gemma 2 only: Gemma 3 ignores it) and of the final logits (None: off).
    MoE archs route each token to num_experts_per_tok of num_experts experts. Qwen3-MoE only: experts of
    moe_intermediate_size (None: intermediate_size), dense layers at mlp_only_layers, norm_topk_prob.
    """
    from transformers import (
        AutoModelForCausalLM,
        Gemma2Config,
        Gemma3TextConfig,
        GenerationConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
    head_dim = hidden_size // num_heads
    original_max_position_embeddings = original_max_position_embeddings or max_position_embeddings // 4
    if rope_scaling == "llama3":
        rope_scaling = LLAMA3_ROPE_SCALING
    elif rope_scaling == "longrope":
        rope_scaling = _longrope_scaling(int(head_dim * partial_rotary_factor), original_max_position_embeddings, seed)
    elif isinstance(rope_scaling, str):
        raise ValueError(f"unknown rope scaling {rope_scaling!r}; expected 'llama3', 'longrope' or a dict")
    cls: type[transformers.PretrainedConfig]
    extra: dict[str, Any]
    if arch == "llama":
        cls, theta, extra, tie = LlamaConfig, 500_000.0, {"head_dim": head_dim, "attention_bias": False}, False
    elif arch == "qwen2":  # Qwen2 attention always has q/k/v bias
        cls, theta, extra, tie = Qwen2Config, 1_000_000.0, {"use_sliding_window": False}, True
    elif arch == "qwen3":  # Qwen3 adds per-head q/k RMSNorm; head_dim must be explicit (its default is 128)
        cls, theta, extra, tie = Qwen3Config, 1_000_000.0, {"head_dim": head_dim, "attention_bias": False}, True
    elif arch == "mixtral":
        extra = {"head_dim": head_dim, "num_local_experts": num_experts, "num_experts_per_tok": num_experts_per_tok,
                 "sliding_window": None}
        cls, theta, tie = MixtralConfig, 1_000_000.0, False
    elif arch == "qwen3_moe":
        extra = {"head_dim": head_dim, "attention_bias": False, "use_sliding_window": False,
                 "num_experts": num_experts, "num_experts_per_tok": num_experts_per_tok, "decoder_sparse_step": 1,
                 "moe_intermediate_size": moe_intermediate_size or intermediate_size,
                 "mlp_only_layers": list(mlp_only_layers or []), "norm_topk_prob": norm_topk_prob}
        cls, theta, tie = Qwen3MoeConfig, 1_000_000.0, False
    elif arch == "phi3":  # Phi-3 fuses qkv_proj and gate_up_proj in its checkpoint
        extra = {"partial_rotary_factor": partial_rotary_factor, "sliding_window": None,
                 "original_max_position_embeddings": original_max_position_embeddings}
        cls, theta, tie = Phi3Config, 10_000.0, False
    elif arch == "mistral":
        extra = {"head_dim": head_dim, "sliding_window": sliding_window}
        cls, theta, tie = MistralConfig, 1_000_000.0, False
    elif arch in ("gemma2", "gemma3"):
        pattern = sliding_window_pattern or (2 if arch == "gemma2" else 6)
        extra = {"head_dim": head_dim, "query_pre_attn_scalar": head_dim, "sliding_window": sliding_window or 4096,
                 "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                 for i in range(num_layers)],
                 "attn_logit_softcapping": attn_logit_softcapping, "final_logit_softcapping": final_logit_softcapping}
        cls, theta, tie = (Gemma2Config, 10_000.0, True) if arch == "gemma2" else (Gemma3TextConfig, 1_000_000.0, True)
    else:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")

    tokenizer = build_tokenizer(vocab_size, seed)
    ids: dict[str, Any] = {f"{t}_token_id": getattr(tokenizer, f"{t}_token_id") for t in ("bos", "eos", "pad")}
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
        **(_gemma3_rope(theta) if arch == "gemma3" else _rope_kwargs(cls, theta, rope_scaling)),
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
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default: the user cache, ~/.cache/raylm/models/<key>/tiny-<arch>)")
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
    p.add_argument("--rope-scaling", choices=["llama3", "longrope"], default=None)
    p.add_argument("--num-experts", type=int, default=4, help="MoE archs: routed experts per layer")
    p.add_argument("--num-experts-per-tok", type=int, default=2, help="MoE archs: experts per token")
    p.add_argument("--moe-intermediate-size", type=int, default=None, help="qwen3_moe: expert MLP size")
    p.add_argument("--mlp-only-layers", type=int, nargs="*", default=None, help="qwen3_moe: dense layers")
    p.add_argument("--norm-topk-prob", action=argparse.BooleanOptionalAction, default=True,
                   help="qwen3_moe: renormalise the top-k router weights")
    p.add_argument("--partial-rotary-factor", type=float, default=1.0, help="phi3: share of each head that rotates")
    p.add_argument("--original-max-position-embeddings", type=int, default=None,
                   help="longrope: the pre-training context (default: a quarter of --max-position-embeddings)")
    p.add_argument("--sliding-window", type=int, default=None, help="mistral, gemma2/3: the sliding layers' window")
    p.add_argument("--sliding-window-pattern", type=int, default=None, help="gemma2/3: every n-th layer is global")
    p.add_argument("--attn-logit-softcapping", type=float, default=None, help="gemma2: attention scores' soft-cap")
    p.add_argument("--final-logit-softcapping", type=float, default=None, help="gemma2/3: final logits' soft-cap")
    p.add_argument("--force", action="store_true",
                   help="with --out: rewrite the checkpoint even if one is there (the cache is keyed by content)")

    start = time.perf_counter()
    out = make_tiny_model(**vars(p.parse_args(argv)))
    print(f"{out}  ({count_parameters(out):,} parameters, {time.perf_counter() - start:.2f}s)")
