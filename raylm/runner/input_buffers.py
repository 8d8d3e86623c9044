"""The ModelRunner's persistent input buffers, and the packing of a step into them.

Allocated once at max size, each step writes a prefix: no per-step allocation, and fixed addresses (what a CUDA
graph replays on). The names are vLLM's: input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_table.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from raylm.common.outputs import SchedulerOutput
from raylm.runner.attention.common import CommonAttentionMetadata, DecodeGraphBuffers
from raylm.runner.input_batch import InputBatch
from raylm.runner.spec_decode.metadata import SpecDecodeMetadata, build_spec_decode_metadata


class CpuGpuBuffer:
    """A CPU tensor with a numpy view, and its device twin (the same tensor on CPU)."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.cpu = torch.zeros(size, dtype=dtype, pin_memory=pin)
        self.np = self.cpu.numpy()
        self.gpu = self.cpu if device.type == "cpu" else torch.zeros(size, dtype=dtype, device=device)

    def copy_to_device(self, n: int) -> None:
        if self.gpu is not self.cpu:
            self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)


@dataclass
class PreparedInputs:
    """One step packed into the buffers: the backend-independent attention metadata, the InputBatch rows that
    sample and logits_indices (the last scheduled token of each of those rows)."""

    common: CommonAttentionMetadata
    num_tokens: int
    num_reqs: int
    sampling_rows: np.ndarray
    logits_indices: torch.Tensor
    spec_decode_metadata: SpecDecodeMetadata | None = None  # where the drafts are; None: no request has any
    uniform_decode_query_len: int = 1  # 1 + k with speculative decoding
    sliding_common: CommonAttentionMetadata | None = None  # the sliding layers' group's (kv_cache_groups.py)

    @property
    def uniform_decode(self) -> bool:
        # Each request has at least one scheduled token: q tokens per request and none longer is all decode of q.
        q = self.uniform_decode_query_len
        return self.num_tokens == self.num_reqs * q and self.common.max_query_len == q


class InputBuffers:
    def __init__(self, max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int, block_size: int,
                 device: torch.device, uniform_decode_query_len: int = 1) -> None:
        self.max_num_tokens, self.max_num_reqs = max_num_tokens, max_num_reqs
        self.uniform_decode_query_len = uniform_decode_query_len
        self.max_blocks_per_req, self.block_size, self.device = max_blocks_per_req, block_size, device
        self.input_ids = CpuGpuBuffer(max_num_tokens, torch.int64, device)
        self.positions = CpuGpuBuffer(max_num_tokens, torch.int64, device)
        self.slot_mapping = CpuGpuBuffer(max_num_tokens, torch.int64, device)
        self.query_start_loc = CpuGpuBuffer(max_num_reqs + 1, torch.int32, device)
        self.seq_lens = CpuGpuBuffer(max_num_reqs, torch.int32, device)
        self.block_table = torch.zeros((max_num_reqs, max_blocks_per_req), dtype=torch.int32, device=device)
        # The sliding layers' slots and block table where the KV cache splits in two groups (kv_cache_groups.py).
        self.sliding_slot_mapping = CpuGpuBuffer(max_num_tokens, torch.int64, device)
        self.sliding_block_table = torch.zeros_like(self.block_table)
        self._arange = np.arange(max(max_num_tokens, max_num_reqs) + 1, dtype=np.int64)
        # query_start_loc of padding requests (one token each) in a fixed-buffer decode, copied on the device.
        self._arange_gpu = torch.arange(max_num_reqs + 1, dtype=torch.int32, device=device)

    def prepare(self, scheduler_output: SchedulerOutput, batch: InputBatch,
                num_draft_tokens: np.ndarray | None = None) -> PreparedInputs:
        """Pack the scheduled tokens of the InputBatch rows. The backend builds its own metadata once the batch
        decision is taken: per micro-batch, or not at all for a CUDA graph replay. `num_draft_tokens` per row:
        speculative decoding's drafts, written in each row after its known tokens and scheduled after them."""
        num_reqs = batch.num_reqs
        num_scheduled_tokens = scheduler_output.num_scheduled_tokens
        num_scheduled = np.array([num_scheduled_tokens[r] for r in batch.live_req_ids], dtype=np.int64)
        cu_num_tokens = num_scheduled.cumsum()
        num_tokens = int(cu_num_tokens[-1])
        assert num_tokens == scheduler_output.total_num_scheduled_tokens

        computed = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        positions = self.positions.np[:num_tokens]
        if num_tokens == num_reqs:  # one token per request (decode): token i belongs to row i
            req_indices = self._arange[:num_reqs]
            positions[:] = computed
        else:
            req_indices = self._arange[:num_reqs].repeat(num_scheduled)
            offsets = self._arange[:num_tokens] - (cu_num_tokens - num_scheduled).repeat(num_scheduled)
            np.add(computed[req_indices], offsets, out=positions)

        token_index = positions + req_indices * batch.max_model_len
        batch.token_ids_cpu.ravel().take(token_index, out=self.input_ids.np[:num_tokens])
        block_index = req_indices * self.max_blocks_per_req + positions // self.block_size
        block_numbers = batch.block_table.table.ravel()[block_index].astype(np.int64)
        np.add(block_numbers * self.block_size, positions % self.block_size, out=self.slot_mapping.np[:num_tokens])
        if batch.sliding_block_table is not None:
            block_numbers = batch.sliding_block_table.table.ravel()[block_index].astype(np.int64)
            np.add(block_numbers * self.block_size, positions % self.block_size,
                   out=self.sliding_slot_mapping.np[:num_tokens])

        query_start_loc = self.query_start_loc.np
        query_start_loc[0] = 0
        query_start_loc[1 : num_reqs + 1] = cu_num_tokens
        seq_lens = computed + num_scheduled
        self.seq_lens.np[:num_reqs] = seq_lens
        # Partial prefills do not sample: their last scheduled token is not the last known one.
        sampling_rows = np.flatnonzero(seq_lens >= batch.num_tokens[:num_reqs])
        spec = None
        if num_draft_tokens is not None and num_draft_tokens.any():
            spec = self._spec_decode_metadata(batch, sampling_rows, num_draft_tokens, cu_num_tokens)
            logits_indices = spec.logits_indices
        else:
            logits_indices = torch.from_numpy(cu_num_tokens[sampling_rows] - 1).to(self.device, non_blocking=True)

        max_blocks = int(batch.block_table.num_blocks[:num_reqs].max())
        self.block_table[:num_reqs, :max_blocks].copy_(
            torch.from_numpy(batch.block_table.table[:num_reqs, :max_blocks]), non_blocking=True)
        common = self.common_metadata(num_reqs, num_tokens, max_blocks, int(num_scheduled.max()), int(seq_lens.max()))
        sliding_common = None
        if batch.sliding_block_table is not None:  # the same rows, their sliding group's ids and slots
            self.sliding_block_table[:num_reqs, :max_blocks].copy_(
                torch.from_numpy(batch.sliding_block_table.table[:num_reqs, :max_blocks]), non_blocking=True)
            self.sliding_slot_mapping.copy_to_device(num_tokens)
            sliding_common = replace(common, block_table=self.sliding_block_table[:num_reqs, :max_blocks],
                                     slot_mapping=self.sliding_slot_mapping.gpu[:num_tokens])
        return PreparedInputs(common, num_tokens, num_reqs, sampling_rows, logits_indices, spec,
                              self.uniform_decode_query_len, sliding_common)

    def _spec_decode_metadata(self, batch: InputBatch, sampling_rows: np.ndarray, num_draft_tokens: np.ndarray,
                              cu_num_tokens: np.ndarray) -> SpecDecodeMetadata:
        num_drafts = num_draft_tokens[sampling_rows]
        assert num_drafts.sum() == num_draft_tokens.sum(), "a request with drafts samples"
        offsets = np.arange(int(num_drafts.sum())) - np.repeat(num_drafts.cumsum() - num_drafts, num_drafts)
        draft_rows = np.repeat(sampling_rows, num_drafts)
        draft_token_ids = batch.token_ids_cpu[draft_rows, batch.num_tokens[draft_rows] + offsets]
        return build_spec_decode_metadata(num_drafts, cu_num_tokens[sampling_rows] - 1, draft_token_ids, self.device)

    def common_metadata(self, num_reqs: int, num_tokens: int, max_blocks: int, max_query_len: int,
                        max_seq_len: int) -> CommonAttentionMetadata:
        """Copy the step's prefix of the CPU buffers (the block table is the caller's) to the device and describe
        it."""
        for buffer in (self.input_ids, self.positions, self.slot_mapping):
            buffer.copy_to_device(num_tokens)
        self.query_start_loc.copy_to_device(num_reqs + 1)
        self.seq_lens.copy_to_device(num_reqs)
        return CommonAttentionMetadata(
            query_start_loc=self.query_start_loc.gpu[: num_reqs + 1],
            query_start_loc_cpu=self.query_start_loc.cpu[: num_reqs + 1],
            seq_lens=self.seq_lens.gpu[:num_reqs],
            seq_lens_cpu=self.seq_lens.cpu[:num_reqs],
            block_table=self.block_table[:num_reqs, :max_blocks],
            slot_mapping=self.slot_mapping.gpu[:num_tokens],
            num_reqs=num_reqs,
            num_actual_tokens=num_tokens,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
        )

    def pad(self, num_tokens: int, num_tokens_padded: int) -> None:
        """Padding rows after the scheduled tokens: token 0 at position 0, no KV cache slot (-1 writes nothing).
        The attention backends ignore rows past num_actual_tokens (a captured graph sends them to a scratch slot),
        and no padding row is sampled."""
        assert num_tokens <= num_tokens_padded <= self.max_num_tokens, (num_tokens, num_tokens_padded)
        self.input_ids.gpu[num_tokens:num_tokens_padded].zero_()
        self.positions.gpu[num_tokens:num_tokens_padded].zero_()
        self.slot_mapping.gpu[num_tokens:num_tokens_padded].fill_(-1)
        self.sliding_slot_mapping.gpu[num_tokens:num_tokens_padded].fill_(-1)

    def pad_decode_requests(self, num_reqs: int, n: int) -> None:
        """Requests num_reqs..n-1 of a uniform decode batch padded to n (their rows already hold token 0, position 0,
        slot -1): one query token each, seq_len 1 (a fully masked row would give NaN)."""
        self.seq_lens.gpu[num_reqs:n].fill_(1)
        self.query_start_loc.gpu[num_reqs + 1 : n + 1].copy_(self._arange_gpu[num_reqs + 1 : n + 1])

    def decode_graph_buffers(self, n: int, scratch_slot: int, sliding: bool = False) -> DecodeGraphBuffers:
        """The first n rows as a uniform decode batch read at fixed addresses (what a captured graph replays on);
        `sliding`: the sliding group's slots and block table (configs/kv_cache_groups.py)."""
        slot_mapping = self.sliding_slot_mapping if sliding else self.slot_mapping
        block_table = self.sliding_block_table if sliding else self.block_table
        return DecodeGraphBuffers(slot_mapping.gpu[:n], self.seq_lens.gpu[:n], self.query_start_loc.gpu[:n + 1],
                                  block_table[:n], scratch_slot)

    def prepare_profile(self, num_tokens: int, max_model_len: int) -> CommonAttentionMetadata:
        """The profile run's batch (runner/profile_run.py): requests of min(num_tokens, max_model_len) query tokens
        (the last one shorter), at most max_num_reqs of them, each ending a max_model_len context over the blocks
        0..; slot -1 for every token, so nothing is written."""
        query_len = min(num_tokens, max_model_len)
        num_reqs = min(-(-num_tokens // query_len), self.max_num_reqs)
        num_tokens = min(num_tokens, num_reqs * query_len)
        query_lens = np.full(num_reqs, query_len, dtype=np.int64)
        query_lens[-1] = num_tokens - query_len * (num_reqs - 1)
        cu_num_tokens = query_lens.cumsum()
        starts = cu_num_tokens - query_lens
        req_indices = np.repeat(np.arange(num_reqs), query_lens)
        offsets = np.arange(num_tokens) - starts[req_indices]
        self.positions.np[:num_tokens] = max_model_len - query_lens[req_indices] + offsets
        self.input_ids.np[:num_tokens] = 0
        self.slot_mapping.np[:num_tokens] = -1
        self.query_start_loc.np[0] = 0
        self.query_start_loc.np[1 : num_reqs + 1] = cu_num_tokens
        self.seq_lens.np[:num_reqs] = max_model_len
        self.block_table[:num_reqs].copy_(torch.arange(self.max_blocks_per_req, dtype=torch.int32))
        return self.common_metadata(num_reqs, num_tokens, self.max_blocks_per_req, query_len, max_model_len)
