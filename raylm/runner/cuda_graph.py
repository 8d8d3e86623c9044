"""FULL CUDA graphs of uniform decode batches: one per padded batch size, captured largest first into one memory pool
(the smaller graphs reuse the largest one's memory) after the KV cache is allocated, replayed on the runner's
persistent buffers (input ids, positions, slot mapping, seq_lens, query_start_loc, block table) with attention reading
only those (the backend's build_decode_graph: torch, triton and flash_attn have one)."""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from raylm.runner.attention.backend import AttentionBackend
from raylm.runner.attention.common import CommonAttentionMetadata
from raylm.runner.batch_descriptor import BatchDescriptor, CUDAGraphMode
from raylm.runner.cudagraph_dispatcher import CudagraphDispatcher
from raylm.runner.forward_context import set_forward_context
from raylm.runner.input_buffers import InputBuffers

if TYPE_CHECKING:
    from raylm.runner.layers.attention import Attention


class CUDAGraphRunner:
    def __init__(self) -> None:
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # The captured forwards' outputs: fixed tensors that every replay of their graph overwrites.
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool: tuple[int, int] | None = None
        self.num_captures: Counter[int] = Counter()  # per padded size: what gpu_check proves
        self.num_replays: Counter[int] = Counter()

    def capture(self, sizes: list[int], body: Callable[[int], torch.Tensor]) -> None:
        """Capture `body(n)` (a forward on the first n rows of persistent buffers) for every n in `sizes`."""
        assert torch.cuda.is_available(), "CUDA graphs are captured on CUDA only"
        self.pool = torch.cuda.graph_pool_handle()
        for n in sorted(sizes, reverse=True):
            # A warm-up run first: lazy initialisation (cuBLAS handles, workspaces) must not land in the graph.
            body(n)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                output = body(n)
            assert isinstance(output, torch.Tensor), "graphs are captured for a single pipeline stage"
            self.graphs[n], self.outputs[n] = graph, output
            self.num_captures[n] += 1
        torch.cuda.synchronize()

    def has(self, num_tokens: int) -> bool:
        return num_tokens in self.graphs

    def replay(self, num_tokens: int) -> torch.Tensor:
        """The forward on the current contents of the persistent buffers; the result is overwritten by the next
        replay of the same size."""
        self.graphs[num_tokens].replay()
        self.num_replays[num_tokens] += 1
        return self.outputs[num_tokens]


class DecodeGraphs:
    """The runner's FULL graphs of uniform decode batches (the attention backend's fixed-buffer decode)."""

    def __init__(self, dispatcher: CudagraphDispatcher, attn_backend: AttentionBackend, buffers: InputBuffers,
                 device: torch.device) -> None:
        self.dispatcher, self.attn_backend, self.buffers, self.device = dispatcher, attn_backend, buffers, device
        self.runner: CUDAGraphRunner | None = None
        self.scratch_slot = -1  # the KV cache's extra slot that padded decode rows write to inside a graph
        # The sliding layers' own extra slot where the KV cache splits in two groups (configs/kv_cache_groups.py).
        self.sliding_scratch_slot = -1

    @property
    def enabled(self) -> bool:
        """Whether the resolved graph plan has FULL graphs of uniform decode batches (configs/cudagraph_plan.py turned
        FULL off where the backend has no fixed-buffer decode). True on CPU too when FULL is asked for there, so that
        the padding and scratch-slot paths run in tests (nothing is captured on CPU)."""
        return bool(self.dispatcher.full_capture_sizes)

    def capture(self, model: torch.nn.Module) -> int:
        """Capture the FULL graphs of uniform decode batches (CUDA, after the KV cache exists); returns how many."""
        if self.device.type != "cuda" or not self.enabled:
            return 0
        assert self.scratch_slot >= 0, "initialize_kv_cache first: graphs read the KV cache at fixed addresses"
        sizes = self.dispatcher.full_capture_sizes
        self.buffers.pad(0, max(sizes))
        self.buffers.pad_decode_requests(0, max(sizes))
        self.runner = CUDAGraphRunner()
        self.runner.capture(sizes, lambda n: self.forward(model, n))
        return len(sizes)

    def should_replay(self, descriptor: BatchDescriptor) -> bool:
        """Planned as a replay: FULL, graphs captured, one batch (not micro-batched)."""
        return (descriptor.cudagraph_mode == CUDAGraphMode.FULL and self.runner is not None
                and not descriptor.should_ubatch)

    def can_replay(self, descriptor: BatchDescriptor, common: CommonAttentionMetadata,
                   kv_caches: list[torch.Tensor]) -> bool:
        """A graph of the batch's padded size exists and its fixed buffers hold the batch's keys in every KV cache
        group (`kv_caches`: one layer's cache of each)."""
        n = descriptor.num_tokens_padded
        return (self.should_replay(descriptor) and self.runner is not None and self.runner.has(n)
                and all(self.attn_backend.decode_graph_fits(common.seq_lens_cpu, n, kv_cache,
                                                            self.buffers.max_blocks_per_req) for kv_cache in kv_caches))

    def replay(self, num_reqs: int, n: int) -> torch.Tensor:
        assert self.runner is not None
        self.buffers.pad_decode_requests(num_reqs, n)
        return self.runner.replay(n)

    def report(self) -> dict[str, Any]:
        """The sizes FULL graphs are captured for, and the graphs captured and replayed per padded size so far."""
        if self.runner is None:
            return {"capture_sizes": [], "captured": {}, "replayed": {}}
        return {"capture_sizes": list(self.dispatcher.full_capture_sizes), "captured": dict(self.runner.num_captures),
                "replayed": dict(self.runner.num_replays)}

    def drop(self) -> None:
        """Forget the graphs (sleep mode moves the storages they read)."""
        self.runner = None

    def forward(self, model: torch.nn.Module, n: int) -> torch.Tensor:
        """A uniform decode forward of n (padded) requests whose attention reads only the persistent buffers: what
        capture records. Rows past the batch's requests are padded by InputBuffers.pad_decode_requests."""
        metadata = self.attn_backend.build_decode_graph(self.buffers.decode_graph_buffers(n, self.scratch_slot))
        sliding = None if self.sliding_scratch_slot < 0 else self.attn_backend.build_decode_graph(
            self.buffers.decode_graph_buffers(n, self.sliding_scratch_slot, sliding=True))
        descriptor = BatchDescriptor(n, n, n, True, CUDAGraphMode.FULL)
        with set_forward_context(metadata, n, descriptor, sliding_attn_metadata=sliding):
            output = model(self.buffers.input_ids.gpu[:n], self.buffers.positions.gpu[:n], None)
        assert isinstance(output, torch.Tensor)
        return output

    def memory_estimate(self, layer: Attention, max_seq_len: int, dtype: torch.dtype) -> int:
        """Bytes the largest decode graph adds over the profile run (CUDA): one layer's K/V gathered over the whole
        block-table width, its scores and key slots."""
        if self.device.type != "cuda" or not self.enabled:
            return 0
        element_size = torch.empty((), dtype=dtype).element_size()
        return self.attn_backend.decode_graph_bytes(max(self.dispatcher.full_capture_sizes), max_seq_len,
                                                    layer.num_heads, layer.num_kv_heads, layer.head_size, element_size,
                                                    self.buffers.block_size)
