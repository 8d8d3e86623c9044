"""The persistent input buffers of the ModelRunner and the packing of a step into them.

Allocated once at max size, each step writes a prefix: no per-step allocation, and fixed addresses (what a CUDA
graph replays on). A mixin, as vLLM's runner mixins, so the runner keeps vLLM's attribute names.
"""
from __future__ import annotations

import numpy as np
import torch

from raylm.common.outputs import SchedulerOutput
from raylm.runner.attention.common import CommonAttentionMetadata
from raylm.runner.input_batch import InputBatch


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


class InputBuffersMixin:
    # Set by the ModelRunner before _init_input_buffers.
    device: torch.device
    block_size: int
    max_num_reqs: int
    max_num_tokens: int
    max_blocks_per_req: int
    input_batch: InputBatch

    def _init_input_buffers(self) -> None:
        device = self.device
        self.input_ids = CpuGpuBuffer(self.max_num_tokens, torch.int64, device)
        self.positions = CpuGpuBuffer(self.max_num_tokens, torch.int64, device)
        self.slot_mapping = CpuGpuBuffer(self.max_num_tokens, torch.int64, device)
        self.query_start_loc = CpuGpuBuffer(self.max_num_reqs + 1, torch.int32, device)
        self.seq_lens = CpuGpuBuffer(self.max_num_reqs, torch.int32, device)
        self.block_table = torch.zeros((self.max_num_reqs, self.max_blocks_per_req), dtype=torch.int32, device=device)
        self._arange = np.arange(max(self.max_num_tokens, self.max_num_reqs) + 1, dtype=np.int64)
        # query_start_loc of padding requests (one token each) in a fixed-buffer decode, copied on the device.
        self.arange_gpu = torch.arange(self.max_num_reqs + 1, dtype=torch.int32, device=device)

    def _prepare_inputs(self, scheduler_output: SchedulerOutput
                        ) -> tuple[CommonAttentionMetadata, int, np.ndarray, torch.Tensor]:
        """Pack the scheduled tokens of the InputBatch rows: (the backend-independent attention metadata, num_tokens,
        the rows that sample, logits_indices = the last scheduled token of each of those rows). The backend builds
        its metadata once the batch decision is taken: per micro-batch, or not at all for a CUDA graph replay."""
        batch = self.input_batch
        num_reqs = batch.num_reqs
        num_scheduled_tokens = scheduler_output.num_scheduled_tokens
        num_scheduled = np.array([num_scheduled_tokens[r] for r in batch.req_ids[:num_reqs]], dtype=np.int64)
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

        query_start_loc = self.query_start_loc.np
        query_start_loc[0] = 0
        query_start_loc[1 : num_reqs + 1] = cu_num_tokens
        seq_lens = computed + num_scheduled
        self.seq_lens.np[:num_reqs] = seq_lens
        # Partial prefills do not sample: their last scheduled token is not the last known one.
        sampling_rows = np.flatnonzero(seq_lens >= batch.num_tokens[:num_reqs])
        logits_indices = torch.from_numpy(cu_num_tokens[sampling_rows] - 1).to(self.device, non_blocking=True)

        max_blocks = int(batch.block_table.num_blocks[:num_reqs].max())
        self.block_table[:num_reqs, :max_blocks].copy_(
            torch.from_numpy(batch.block_table.table[:num_reqs, :max_blocks]), non_blocking=True)
        common = self._common_metadata(num_reqs, num_tokens, max_blocks, int(num_scheduled.max()),
                                       int(seq_lens.max()))
        return common, num_tokens, sampling_rows, logits_indices

    def _common_metadata(self, num_reqs: int, num_tokens: int, max_blocks: int, max_query_len: int,
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

    def _pad_inputs(self, num_tokens: int, num_tokens_padded: int) -> None:
        """Padding rows after the scheduled tokens: token 0 at position 0, no KV cache slot (-1 writes nothing).
        The attention backends ignore rows past num_actual_tokens (a captured graph sends them to a scratch slot),
        and no padding row is sampled."""
        assert num_tokens <= num_tokens_padded <= self.max_num_tokens, (num_tokens, num_tokens_padded)
        self.input_ids.gpu[num_tokens:num_tokens_padded].zero_()
        self.positions.gpu[num_tokens:num_tokens_padded].zero_()
        self.slot_mapping.gpu[num_tokens:num_tokens_padded].fill_(-1)
