"""CudagraphDispatcher: the CUDA-graph mode and padded size of a forward, from its token count and whether it is a
uniform decode batch (every request one query token). Device-free: on CPU it decides and pads the same way (so
the padding paths run in tests) and the runner runs the forward eagerly.

Modes are vLLM's. raylm captures FULL graphs of uniform decode batches only (one graph per padded size, the attention
metadata read from fixed buffers); mixed batches run eagerly. With speculative decoding a uniform decode batch is one
of k + 1 tokens per request (vLLM's uniform_decode_query_len): its sizes are multiples of k + 1. PIECEWISE graphs,
which need torch.compile's graph splitting, are refused when the config is built (raylm/configs/engine_config.py).
"""
from __future__ import annotations

import bisect
import logging

from raylm.configs import CompilationConfig, SchedulerConfig
from raylm.runner.batch_descriptor import CUDAGraphMode

logger = logging.getLogger(__name__)

# The mode of uniform decode batches per setting. FULL graphs of mixed batches would need an attention kernel that
# captures any mix of query lengths: under FULL they run eagerly, as under FULL_DECODE_ONLY.
_DECODE_MODES = {"NONE": CUDAGraphMode.NONE, "FULL": CUDAGraphMode.FULL, "FULL_DECODE_ONLY": CUDAGraphMode.FULL}
_MAX_DEFAULT_CAPTURE_SIZE = 512


def default_capture_sizes(max_size: int) -> list[int]:
    """vLLM's list: 1, 2, 4, then every 8 below 256, then every 16, up to `max_size` (included when on the grid)."""
    sizes = [s for s in (1, 2, 4) if s <= max_size]
    sizes += list(range(8, min(max_size, 255) + 1, 8))
    sizes += list(range(256, max_size + 1, 16))
    return sizes


def resolve_cudagraph_mode(compilation: CompilationConfig, device_type: str) -> str:
    """The mode setting in effect (decided once, by the config resolver): enforce_eager wins; unset means
    FULL_DECODE_ONLY where graphs run (CUDA) and NONE on CPU, unless capture sizes are asked for there (to exercise
    padding), where it is FULL_DECODE_ONLY too."""
    if compilation.enforce_eager:
        return "NONE"
    if compilation.cudagraph_mode is not None:
        return compilation.cudagraph_mode
    asked = compilation.cudagraph_capture_sizes is not None or compilation.max_cudagraph_capture_size is not None
    return "FULL_DECODE_ONLY" if device_type == "cuda" or asked else "NONE"


class CudagraphDispatcher:
    def __init__(self, compilation: CompilationConfig, scheduler: SchedulerConfig, device_type: str,
                 why_no_full: str | None = None, uniform_decode_query_len: int = 1) -> None:
        """`compilation` resolved (its cudagraph_mode set). `why_no_full`: why the model cannot run as one captured
        graph (expert parallel reads counts back to the host, pipeline stages exchange tensors, ...); uniform decode
        batches then run eagerly too."""
        assert compilation.cudagraph_mode in _DECODE_MODES, f"cudagraph_mode {compilation.cudagraph_mode} unresolved"
        self.mode_name = compilation.cudagraph_mode
        decode = _DECODE_MODES[self.mode_name]
        if why_no_full is not None and decode == CUDAGraphMode.FULL:
            decode = CUDAGraphMode.NONE
            if device_type == "cuda":
                logger.info("cudagraph_mode %s: no FULL CUDA graphs (%s); decode batches run eagerly",
                            self.mode_name, why_no_full)
        self.mixed_mode, self.decode_mode = CUDAGraphMode.NONE, decode
        limit = scheduler.max_num_batched_tokens
        q = self.uniform_decode_query_len = uniform_decode_query_len
        if compilation.cudagraph_capture_sizes is not None:
            asked = sorted(set(compilation.cudagraph_capture_sizes))
        else:
            largest = compilation.max_cudagraph_capture_size or min(scheduler.max_num_seqs, _MAX_DEFAULT_CAPTURE_SIZE)
            asked = default_capture_sizes(largest * q if compilation.max_cudagraph_capture_size is None else largest)
        if q > 1:  # a padded uniform batch is whole requests of q tokens (vLLM rounds the sizes the same way)
            asked = sorted({-(-size // q) * q for size in asked})
        self.capture_sizes = [s for s in asked if s <= limit]
        if len(self.capture_sizes) < len(asked):
            logger.info("cudagraph_capture_sizes above max_num_batched_tokens (%d) dropped: %s", limit,
                        [s for s in asked if s > limit])
        if not self.capture_sizes:
            self.mixed_mode = self.decode_mode = CUDAGraphMode.NONE
        self.max_capture_size = self.capture_sizes[-1] if self.capture_sizes else 0
        # A uniform decode batch has one request per q tokens: a FULL graph's padded requests must fit the batch rows.
        self.max_num_reqs = scheduler.max_num_seqs

    @property
    def full_capture_sizes(self) -> list[int]:
        """The sizes a FULL graph is captured for (uniform decode batches): none when FULL is never dispatched."""
        if self.decode_mode != CUDAGraphMode.FULL:
            return []
        return [s for s in self.capture_sizes if s // self.uniform_decode_query_len <= self.max_num_reqs]

    def padded_size(self, num_tokens: int) -> int:
        """The smallest capture size >= num_tokens (num_tokens <= max_capture_size)."""
        return self.capture_sizes[bisect.bisect_left(self.capture_sizes, num_tokens)]

    def dispatch(self, num_tokens: int, uniform_decode: bool, has_lora: bool = False) -> tuple[CUDAGraphMode, int]:
        """(mode, padded token count), rounded up to the nearest capture size. Eager and unpadded: a batch larger
        than the largest capture size, or whose mode is NONE (FULL is for uniform decode batches only). Graphs are
        captured without LoRA: a batch with adapters (has_lora, part of the key as in vLLM) runs eagerly."""
        mode = CUDAGraphMode.NONE if has_lora else self.decode_mode if uniform_decode else self.mixed_mode
        if mode == CUDAGraphMode.NONE or num_tokens > self.max_capture_size:
            return CUDAGraphMode.NONE, num_tokens
        padded = self.padded_size(num_tokens)
        if padded // self.uniform_decode_query_len > self.max_num_reqs:  # FULL's padded requests must fit the rows
            return CUDAGraphMode.NONE, num_tokens
        return mode, padded
