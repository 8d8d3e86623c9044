"""The attention backends raylm has, as data the resolver decides from (configs/ imports nothing of runner/): where
each runs, in which dtypes, with which block sizes, and which decode batches its attention can run inside a captured
CUDA graph. runner/attention/ holds the backends themselves; tests/test_resolve.py checks that the two agree.
Whether a backend's kernels import or build here is an EnvironmentFacts input (missing_kernels); what the model's
attention needs (sliding windows, logit soft-capping, attention sinks) is read from its config here too
(attention_features)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from raylm.configs.environment import EnvironmentFacts

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class AttentionBackendSpec:
    name: str
    devices: tuple[str, ...]  # where its kernels run ("cpu" for triton only under TRITON_INTERPRET=1)
    dtypes: tuple[str, ...]
    block_size_multiple: int
    # vLLM's AttentionCGSupport level (runner/attention/backend.py): NEVER, or UNIFORM_SINGLE_TOKEN_DECODE when a
    # decode batch of one token per request reads only fixed buffers (build_decode_graph).
    cudagraph_support: str
    features: frozenset[str] = frozenset()  # of FEATURES: what its kernel does beyond causal attention


# What a model's attention may need beyond causal attention, as the reasons name them.
FEATURES = {"sliding_window": "sliding window", "logits_soft_cap": "logit soft-capping", "sinks": "attention sinks"}
# Architectures whose every attention layer has sinks: a learned logit per head in each softmax's denominator.
_HAS_SINKS = ("GptOssForCausalLM",)
# Gemma 3's config keeps attn_logit_softcapping, but its attention (transformers', vLLM's) does not apply it.
_IGNORES_ATTN_SOFTCAP = ("Gemma3ForCausalLM",)


_ALL_DTYPES = ("float32", "float16", "bfloat16")
ATTENTION_BACKENDS = {
    "torch": AttentionBackendSpec("torch", ("cpu", "cuda"), _ALL_DTYPES, 1, "UNIFORM_SINGLE_TOKEN_DECODE",
                                  frozenset(FEATURES)),
    "cpu": AttentionBackendSpec("cpu", ("cpu",), ("float32", "bfloat16"), 16, "NEVER", frozenset(FEATURES)),
    "triton": AttentionBackendSpec("triton", ("cuda",), _ALL_DTYPES, 1, "UNIFORM_SINGLE_TOKEN_DECODE",
                                   frozenset(FEATURES)),
    # FlashAttention 2's paged KV: pages a multiple of 256 tokens, 16-bit only.
    "flash_attn": AttentionBackendSpec("flash_attn", ("cuda",), ("float16", "bfloat16"), 256,
                                       "UNIFORM_SINGLE_TOKEN_DECODE"),
}
_INSTALL = {"flash_attn": "'raylm[flash]'", "triton": "'raylm[triton]'"}


def layer_sliding_windows(hf_config: PretrainedConfig) -> list[int | None]:
    """Each layer's sliding window (None: global attention), from config.json: `sliding_window` applies to the layers
    `layer_types` names "sliding_attention" (Gemma 2 / 3: transformers fills it from sliding_window_pattern), to
    every layer without `layer_types` (Mistral), and to none where `use_sliding_window` is false (Qwen2) or where the
    window is as long as max_position_embeddings (Phi-3-128k's): such a window never hides a key."""
    num_layers = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    max_position = getattr(hf_config, "max_position_embeddings", None)
    if (not window or getattr(hf_config, "use_sliding_window", True) is False
            or max_position is not None and window >= max_position):
        return [None] * num_layers
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        return [int(window)] * num_layers
    return [int(window) if kind == "sliding_attention" else None for kind in layer_types]


def attention_logits_soft_cap(hf_config: PretrainedConfig) -> float | None:
    """The attention scores' soft-cap the model applies (Gemma 2's attn_logit_softcapping), or None."""
    architectures = getattr(hf_config, "architectures", None) or []
    if architectures and architectures[0] in _IGNORES_ATTN_SOFTCAP:
        return None
    cap = getattr(hf_config, "attn_logit_softcapping", None)
    return float(cap) if cap else None


def attention_features(hf_config: PretrainedConfig | None) -> frozenset[str]:
    """The FEATURES the model's attention needs (none without a config)."""
    if hf_config is None:
        return frozenset()
    needed = {"sliding_window"} if any(w is not None for w in layer_sliding_windows(hf_config)) else set()
    if attention_logits_soft_cap(hf_config) is not None:
        needed.add("logits_soft_cap")
    if (getattr(hf_config, "architectures", None) or [None])[0] in _HAS_SINKS:
        needed.add("sinks")
    return frozenset(needed)


def _lacks(name: str, features: frozenset[str]) -> str | None:
    """What of `features` backend `name` lacks, as a reason ("the cpu kernel has no sliding window"), or None."""
    missing = [FEATURES[f] for f in sorted(features - ATTENTION_BACKENDS[name].features)]
    return f"the {name} kernel has no {' or '.join(missing)}" if missing else None


def why_backend_cannot_run(name: str, device: str, dtype: str, block_size: int, env: EnvironmentFacts,
                           features: frozenset[str] = frozenset()) -> str | None:
    """Why backend `name` cannot run on `device` in `dtype` with `block_size` here, for a model whose attention
    needs `features`, or None when it can."""
    spec = ATTENTION_BACKENDS[name]
    lacks = _lacks(name, features)
    if lacks is not None:
        return f"{lacks}, which this model's attention uses"
    if name in env.missing_kernels:
        return env.missing_kernels[name]
    if device not in spec.devices and not (name == "triton" and device == "cpu" and env.triton_interpret):
        if name == "triton":
            return f"its kernels run on CUDA (device here: {device}), or on CPU only under TRITON_INTERPRET=1"
        return f"it runs on {' or '.join(d.upper() for d in spec.devices)} (device here: {device})"
    if dtype not in spec.dtypes:
        return f"it runs {' or '.join(spec.dtypes)} (dtype here: {dtype})"
    if block_size % spec.block_size_multiple:
        return f"it needs block_size a multiple of {spec.block_size_multiple} (block_size here: {block_size})"
    return None


def choose_attention_backend(name: str, device: str, dtype: str, block_size: int, custom_ops: bool,
                             env: EnvironmentFacts, features: frozenset[str] = frozenset()) -> str:
    """The backend `name` resolves to, checked: "auto" picks the fastest one that runs here and has the `features`
    the model's attention needs (flash_attn, then triton on CUDA; raylm's cpu kernels on CPU unless custom_ops is
    off; else torch, which has them all); a named one must be able to run. Raises a ValueError naming the setting
    and why otherwise."""
    if name == "auto":
        if why_backend_cannot_run("flash_attn", device, dtype, block_size, env, features) is None:
            return "flash_attn"
        if device == "cuda" and why_backend_cannot_run("triton", device, dtype, block_size, env, features) is None:
            return "triton"
        if custom_ops and why_backend_cannot_run("cpu", device, dtype, block_size, env, features) is None:
            return "cpu"
        return "torch"
    if name not in ATTENTION_BACKENDS:
        known = ", ".join(map(repr, ATTENTION_BACKENDS))
        raise ValueError(f"unknown attention backend {name!r}; known: 'auto', {known}")
    if name == "cpu" and not custom_ops:
        raise ValueError("attention_backend 'cpu' needs raylm's CPU kernels, which custom_ops='none' turns off")
    reason = why_backend_cannot_run(name, device, dtype, block_size, env, features)
    if reason is not None:
        others = "'torch' or 'auto'" if name in ("cpu", "triton") else "'triton', 'torch' or 'auto'"
        raise ValueError(f"attention_backend {name!r} is not available: {reason}; use {others}")
    return name


def explain_attention_backend(name: str, device: str, dtype: str, block_size: int, custom_ops: bool,
                              env: EnvironmentFacts, features: frozenset[str] = frozenset()) -> str:
    """The resolved backend for the engine-config line, with why where the model's attention steered "auto" off the
    backend it picks otherwise: e.g. "torch (the cpu kernel has no sliding window)"."""
    chosen = choose_attention_backend(name, device, dtype, block_size, custom_ops, env, features)
    usual = choose_attention_backend(name, device, dtype, block_size, custom_ops, env) if name == "auto" else chosen
    lacks = _lacks(usual, features) if usual != chosen else None
    return chosen if lacks is None else f"{chosen} ({lacks})"


def missing_kernel_message(name: str, error: str) -> str:
    """Why a backend's package does not import (`error`), with the extra that installs it."""
    package = "flash-attn" if name == "flash_attn" else name
    return f"the {package} package does not import ({error}); install it with pip install {_INSTALL[name]}"
