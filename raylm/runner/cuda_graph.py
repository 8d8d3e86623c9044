"""FULL CUDA graphs of the model: one per padded batch size, captured largest first into one memory pool (the
smaller graphs reuse the largest one's memory) after the KV cache is allocated, replayed on the runner's persistent
buffers (input ids, positions, slot mapping, seq_lens, query_start_loc, block table) with attention reading only
those (the backend's build_decode_graph: torch, triton and flash_attn have one)."""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

from raylm.runner.attention.backend import AttentionBackend, AttentionCGSupport
from raylm.runner.attention.common import DecodeGraphBuffers
from raylm.runner.batch_descriptor import BatchDescriptor, CUDAGraphMode
from raylm.runner.cudagraph_dispatcher import CudagraphDispatcher
from raylm.runner.forward_context import set_forward_context
from raylm.runner.input_buffers import InputBuffersMixin


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


class CUDAGraphCaptureMixin(InputBuffersMixin):
    """The ModelRunner's FULL graphs of uniform decode batches (the attention backend's fixed-buffer decode)."""

    # Set by the ModelRunner.
    model: torch.nn.Module | None
    dtype: torch.dtype
    attn_backend: AttentionBackend
    kv_caches: list[torch.Tensor]
    cudagraph_dispatcher: CudagraphDispatcher
    graph_runner: CUDAGraphRunner | None
    scratch_slot: int
    attention_layers: Callable[[], list[torch.nn.Module]]

    def _captures_decode_graphs(self) -> bool:
        """Whether FULL graphs of uniform decode batches can be built: the backend has a fixed-buffer decode. True on
        CPU too when FULL is asked for there, so that path runs in tests (nothing is captured on CPU)."""
        fixed_buffer_decode = self.attn_backend.cudagraph_support >= AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        return bool(self.cudagraph_dispatcher.full_capture_sizes) and fixed_buffer_decode

    @torch.inference_mode()
    def capture_model(self) -> int:
        """Capture the FULL graphs of uniform decode batches (CUDA, after the KV cache exists); returns how many."""
        if self.device.type != "cuda" or not self._captures_decode_graphs():
            return 0
        assert self.kv_caches, "initialize_kv_cache first: graphs read the KV cache at fixed addresses"
        sizes = self.cudagraph_dispatcher.full_capture_sizes
        self._pad_inputs(0, max(sizes))
        self._pad_decode_graph_inputs(0, max(sizes))
        self.graph_runner = CUDAGraphRunner()
        self.graph_runner.capture(sizes, self._decode_graph_forward)
        return len(sizes)

    def _pad_decode_graph_inputs(self, num_reqs: int, n: int) -> None:
        """Requests num_reqs..n-1 of a uniform decode batch padded to n (their rows already hold token 0, position 0,
        slot -1): one query token each, seq_len 1 (a fully masked row would give NaN)."""
        self.seq_lens.gpu[num_reqs:n].fill_(1)
        self.query_start_loc.gpu[num_reqs + 1 : n + 1].copy_(self.arange_gpu[num_reqs + 1 : n + 1])

    def _decode_graph_forward(self, n: int) -> torch.Tensor:
        """A uniform decode forward of n (padded) requests whose attention reads only the persistent buffers: what
        capture_model records. Rows past the batch's requests are padded by _pad_decode_graph_inputs."""
        assert self.model is not None
        buffers = DecodeGraphBuffers(self.slot_mapping.gpu[:n], self.seq_lens.gpu[:n], self.query_start_loc.gpu[:n + 1],
                                     self.block_table[:n], self.scratch_slot)
        metadata = self.attn_backend.build_decode_graph(buffers)
        with set_forward_context(metadata, n, BatchDescriptor(n, n, n, True, CUDAGraphMode.FULL)):
            output = self.model(self.input_ids.gpu[:n], self.positions.gpu[:n], None)
        assert isinstance(output, torch.Tensor)
        return output

    def cudagraph_memory_estimate(self) -> int:
        """Bytes the largest decode graph adds over the profile run (CUDA): one layer's K/V gathered over the whole
        block-table width, its scores and key slots."""
        if self.device.type != "cuda" or not self._captures_decode_graphs():
            return 0
        element_size = torch.empty((), dtype=self.dtype).element_size()
        layer = self.attention_layers()[0]
        return self.attn_backend.decode_graph_bytes(max(self.cudagraph_dispatcher.full_capture_sizes),
                                                    self.max_blocks_per_req * self.block_size, layer.num_heads,
                                                    layer.num_kv_heads, layer.head_size, element_size,
                                                    self.block_size)
