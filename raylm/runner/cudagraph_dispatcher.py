"""CudagraphDispatcher: the CUDA-graph mode and padded size of a forward, from its token count and whether it is a
uniform decode batch (every request the same query rows). It follows the resolved graph plan
(configs/cudagraph_plan.py: the mode in effect and the capture sizes, decided once) and decides nothing of its own.
Device-free: on CPU it pads the same way (so the padding paths run in tests) and the runner runs the forward eagerly.
"""
from __future__ import annotations

import bisect

from raylm.configs.cudagraph_plan import CUDAGraphPlan
from raylm.runner.batch_descriptor import CUDAGraphMode


class CudagraphDispatcher:
    def __init__(self, plan: CUDAGraphPlan) -> None:
        self.mode_name = plan.mode
        # FULL graphs of mixed batches would need an attention kernel that captures any mix of query lengths: they run
        # eagerly under FULL, as under FULL_DECODE_ONLY.
        self.mixed_mode = CUDAGraphMode.NONE
        self.decode_mode = CUDAGraphMode.NONE if plan.mode == "NONE" else CUDAGraphMode.FULL
        self.capture_sizes = list(plan.capture_sizes)
        self.max_capture_size = self.capture_sizes[-1] if self.capture_sizes else 0

    @property
    def full_capture_sizes(self) -> list[int]:
        """The sizes a FULL graph is captured for (uniform decode batches): none when FULL is never dispatched."""
        return self.capture_sizes if self.decode_mode == CUDAGraphMode.FULL else []

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
        return mode, self.padded_size(num_tokens)
