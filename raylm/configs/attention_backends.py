"""The attention backends raylm has, as data the resolver decides from (configs/ imports nothing of runner/): where
each runs, in which dtypes, with which block sizes, and which decode batches its attention can run inside a captured
CUDA graph. runner/attention/ holds the backends themselves; tests/test_resolve.py checks that the two agree.
Whether a backend's kernels import or build here is an EnvironmentFacts input (missing_kernels)."""
from __future__ import annotations

from dataclasses import dataclass

from raylm.configs.environment import EnvironmentFacts


@dataclass(frozen=True)
class AttentionBackendSpec:
    name: str
    devices: tuple[str, ...]  # where its kernels run ("cpu" for triton only under TRITON_INTERPRET=1)
    dtypes: tuple[str, ...]
    block_size_multiple: int
    # vLLM's AttentionCGSupport level (runner/attention/backend.py): NEVER, or UNIFORM_SINGLE_TOKEN_DECODE when a
    # decode batch of one token per request reads only fixed buffers (build_decode_graph).
    cudagraph_support: str


_ALL_DTYPES = ("float32", "float16", "bfloat16")
ATTENTION_BACKENDS = {
    "torch": AttentionBackendSpec("torch", ("cpu", "cuda"), _ALL_DTYPES, 1, "UNIFORM_SINGLE_TOKEN_DECODE"),
    "cpu": AttentionBackendSpec("cpu", ("cpu",), ("float32", "bfloat16"), 16, "NEVER"),
    "triton": AttentionBackendSpec("triton", ("cuda",), _ALL_DTYPES, 1, "UNIFORM_SINGLE_TOKEN_DECODE"),
    # FlashAttention 2's paged KV: pages a multiple of 256 tokens, 16-bit only.
    "flash_attn": AttentionBackendSpec("flash_attn", ("cuda",), ("float16", "bfloat16"), 256,
                                       "UNIFORM_SINGLE_TOKEN_DECODE"),
}
_INSTALL = {"flash_attn": "'raylm[flash]'", "triton": "'raylm[triton]'"}


def why_backend_cannot_run(name: str, device: str, dtype: str, block_size: int, env: EnvironmentFacts) -> str | None:
    """Why backend `name` cannot run on `device` in `dtype` with `block_size` here, or None when it can."""
    spec = ATTENTION_BACKENDS[name]
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
                             env: EnvironmentFacts) -> str:
    """The backend `name` resolves to, checked: "auto" picks the fastest one that runs here (flash_attn, then triton
    on CUDA; raylm's cpu kernels on CPU unless custom_ops is off; else torch); a named one must be able to run.
    Raises a ValueError naming the setting and why otherwise."""
    if name == "auto":
        if why_backend_cannot_run("flash_attn", device, dtype, block_size, env) is None:
            return "flash_attn"
        if device == "cuda" and why_backend_cannot_run("triton", device, dtype, block_size, env) is None:
            return "triton"
        if custom_ops and why_backend_cannot_run("cpu", device, dtype, block_size, env) is None:
            return "cpu"
        return "torch"
    if name not in ATTENTION_BACKENDS:
        known = ", ".join(map(repr, ATTENTION_BACKENDS))
        raise ValueError(f"unknown attention backend {name!r}; known: 'auto', {known}")
    if name == "cpu" and not custom_ops:
        raise ValueError("attention_backend 'cpu' needs raylm's CPU kernels, which custom_ops='none' turns off")
    reason = why_backend_cannot_run(name, device, dtype, block_size, env)
    if reason is not None:
        others = "'torch' or 'auto'" if name in ("cpu", "triton") else "'triton', 'torch' or 'auto'"
        raise ValueError(f"attention_backend {name!r} is not available: {reason}; use {others}")
    return name


def missing_kernel_message(name: str, error: str) -> str:
    """Why a backend's package does not import (`error`), with the extra that installs it."""
    package = "flash-attn" if name == "flash_attn" else name
    return f"the {package} package does not import ({error}); install it with pip install {_INSTALL[name]}"
