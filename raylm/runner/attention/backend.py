"""The attention backend interface: a paged KV cache layout, a per-step metadata builder and the attention
op itself (write new K/V through `slot_mapping`, then varlen causal GQA attention over the cache)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import IntEnum
from typing import ClassVar

import torch

from raylm.runner.attention.common import CommonAttentionMetadata, DecodeGraphBuffers


@dataclass
class AttentionMetadata:
    """Base of every backend's per-step metadata. It names the backend that built it, so the attention
    layers run whatever backend the runner built the step for."""

    backend: AttentionBackend
    num_actual_tokens: int


class AttentionCGSupport(IntEnum):
    """Which batches a backend's attention can run inside a captured CUDA graph (vLLM's levels)."""

    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1  # every request one query token, metadata in fixed buffers
    UNIFORM_BATCH = 2
    ALWAYS = 3


class AttentionBackend(ABC):
    name: ClassVar[str]
    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    @staticmethod
    @abstractmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor."""

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        """Everything the layers of one step share, computed once per step. The block size is not part of
        `common`: backends read it from the KV cache (`kv_cache.shape` per `get_kv_cache_shape`)."""

    def build_decode_graph(self, buffers: DecodeGraphBuffers) -> AttentionMetadata:
        """The metadata of a uniform decode batch that reads only `buffers` (every shape fixed by the padded size):
        what a FULL CUDA graph captures. Only backends whose cudagraph_support is not NEVER have it."""
        raise NotImplementedError(f"attention backend {self.name!r} has no fixed-buffer decode for CUDA graphs")

    def decode_graph_fits(self, seq_lens_cpu: torch.Tensor, num_reqs_padded: int, kv_cache: torch.Tensor,
                          max_blocks_per_req: int) -> bool:
        """Whether a captured decode of `num_reqs_padded` requests can serve the batch of these seq_lens (read on
        the host from the CPU copy); when not, the step runs eagerly. Every batch fits by default."""
        return True

    def decode_graph_bytes(self, num_reqs: int, max_keys: int, num_heads: int, num_kv_heads: int, head_size: int,
                           element_size: int, block_size: int) -> int:
        """Memory one layer's fixed-buffer decode of `num_reqs` requests allocates beyond its output (part of the
        CUDA-graph estimate); none by default."""
        return 0

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        """query [T, num_heads, head_size], key/value [T, num_kv_heads, head_size] (T >= num_actual_tokens;
        padding rows are ignored) -> output [T, num_heads * head_size], zero in padding rows."""
