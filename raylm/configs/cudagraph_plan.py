"""The CUDA-graph plan, decided once at resolution: the mode in effect and the padded sizes of uniform decode batches.

Modes are vLLM's. raylm captures FULL graphs of uniform decode batches only (one graph per padded size, the attention
metadata read from fixed buffers); mixed batches run eagerly. With speculative decoding a uniform decode batch is one
of k + 1 tokens per request (vLLM's uniform_decode_query_len): its sizes are multiples of k + 1. A model that cannot
replay as one graph (why_no_full_graphs) gets mode NONE here, so the logged mode is the one that runs. On CPU nothing
is captured: FULL only pads there (so tests run the padding paths). PIECEWISE modes are refused when the config is
built (configs/engine_config.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from raylm.configs.attention_backends import ATTENTION_BACKENDS
from raylm.configs.engine_config import CompilationConfig, SchedulerConfig

_MAX_DEFAULT_CAPTURE_SIZE = 512


@dataclass(frozen=True)
class CUDAGraphPlan:
    # The mode in effect: NONE, or FULL / FULL_DECODE_ONLY (the same here: FULL graphs of uniform decode batches).
    mode: str
    capture_sizes: tuple[int, ...]  # padded token counts of uniform decode batches, ascending; empty under NONE
    why_no_full: str = ""  # why a FULL mode asked for became NONE ("" when it did not)


def default_capture_sizes(max_size: int) -> list[int]:
    """vLLM's list: 1, 2, 4, then every 8 below 256, then every 16, up to `max_size` (included when on the grid)."""
    sizes = [s for s in (1, 2, 4) if s <= max_size]
    sizes += list(range(8, min(max_size, 255) + 1, 8))
    sizes += list(range(256, max_size + 1, 16))
    return sizes


def resolve_cudagraph_mode(compilation: CompilationConfig, device: str) -> str:
    """The mode setting: enforce_eager wins; unset means FULL_DECODE_ONLY where graphs run (CUDA) and NONE on CPU,
    unless capture sizes are asked for there (to exercise padding), where it is FULL_DECODE_ONLY too."""
    if compilation.enforce_eager:
        return "NONE"
    if compilation.cudagraph_mode is not None:
        return compilation.cudagraph_mode
    asked = compilation.cudagraph_capture_sizes is not None or compilation.max_cudagraph_capture_size is not None
    return "FULL_DECODE_ONLY" if device == "cuda" or asked else "NONE"


def why_grouped_mm_syncs(device: str, dtype: str, cuda_capability: tuple[int, int]) -> str | None:
    """Why the experts' grouped matmul reads back to the host (None: it does not): torch's grouped matmul kernel
    takes bfloat16 on CUDA devices of compute capability 9 and 10; its fallback copies the ends to the host."""
    if device != "cuda" or dtype != "bfloat16":
        return f"the experts' grouped matmul runs as one kernel only in bfloat16 on CUDA (here: {device}, {dtype})"
    major, minor = cuda_capability
    if major not in (9, 10):
        seen = f"{major}.{minor}" if major else "not seen by this process"
        return f"the experts' grouped matmul runs as one kernel on compute capability 9.x or 10.x (here: {seen})"
    return None


def why_no_full_graphs(is_moe: bool, pipeline_parallel: bool, device: str, dtype: str, attention_backend: str,
                       uniform_decode_query_len: int, cuda_capability: tuple[int, int]) -> str | None:
    """Why this model cannot replay as one captured graph (None: it can). On CPU nothing is captured, so only the
    pipeline matters there. Expert parallel can: a FULL forward exchanges tokens through fixed-capacity buffers
    (runner/distributed/fixed_capacity.py)."""
    if is_moe and device == "cuda":
        reason = why_grouped_mm_syncs(device, dtype, cuda_capability)
        if reason is not None:
            return reason
    if pipeline_parallel:
        return "pipeline stages exchange tensors between forwards"
    support = ATTENTION_BACKENDS[attention_backend].cudagraph_support
    if device == "cuda" and support == "NEVER":
        return f"attention backend {attention_backend!r} has no fixed-buffer decode"
    if device == "cuda" and uniform_decode_query_len > 1 and support == "UNIFORM_SINGLE_TOKEN_DECODE":
        return (f"attention backend {attention_backend!r} captures one-token decodes only, and speculative decoding's "
                f"decode batches have {uniform_decode_query_len} tokens per request")
    return None


def plan_cuda_graphs(compilation: CompilationConfig, scheduler: SchedulerConfig, device: str,
                     uniform_decode_query_len: int, why_no_full: str | None) -> CUDAGraphPlan:
    """The mode in effect and the capture sizes: the asked sizes (default: vLLM's list up to max_num_seqs requests),
    rounded up to whole requests of `uniform_decode_query_len` tokens, without those past the step's token budget
    or of more requests than a batch holds (a padded batch must fit both)."""
    mode = resolve_cudagraph_mode(compilation, device)
    if mode == "NONE":
        return CUDAGraphPlan("NONE", ())
    if why_no_full is not None:
        return CUDAGraphPlan("NONE", (), why_no_full)
    q = uniform_decode_query_len
    if compilation.cudagraph_capture_sizes is not None:
        asked = sorted(set(compilation.cudagraph_capture_sizes))
    elif compilation.max_cudagraph_capture_size is not None:
        asked = default_capture_sizes(compilation.max_cudagraph_capture_size)
    else:
        asked = default_capture_sizes(min(scheduler.max_num_seqs, _MAX_DEFAULT_CAPTURE_SIZE) * q)
    if q > 1:  # a padded uniform batch is whole requests of q tokens (vLLM rounds the sizes the same way)
        asked = sorted({-(-size // q) * q for size in asked})
    sizes = tuple(s for s in asked if s <= scheduler.max_num_batched_tokens and s // q <= scheduler.max_num_seqs)
    if not sizes:
        return CUDAGraphPlan("NONE", (), f"no capture size fits max_num_batched_tokens "
                                         f"({scheduler.max_num_batched_tokens}) and max_num_seqs "
                                         f"({scheduler.max_num_seqs})")
    return CUDAGraphPlan(mode, sizes)
