"""The persistent batch: one row per request the device is running, kept across steps.

Each step applies the scheduler's diff (add, remove, new blocks, new tokens) instead of
rebuilding. Removed rows leave holes that the next added request fills; `condense` then moves
tail rows into the remaining holes so rows 0..num_reqs-1 are always the live ones.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch

from raylm.common.lora_request import LoRARequest
from raylm.common.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """What the runner knows of a request, kept even while it is not in the batch."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    lora_request: LoRARequest | None = None
    sliding_block_ids: list[int] = field(default_factory=list)  # the sliding layers' group's (kv_cache_groups.py)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class BlockTable:
    """Block ids of each row, in a fixed [max_num_reqs, max_blocks_per_req] array."""

    def __init__(self, max_num_reqs: int, max_blocks_per_req: int) -> None:
        self.max_blocks_per_req = max_blocks_per_req
        self.table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)

    def set_row(self, row: int, block_ids: list[int]) -> None:
        self.num_blocks[row] = 0
        self.append_row(row, block_ids)

    def append_row(self, row: int, block_ids: list[int]) -> None:
        start, end = self.num_blocks[row], self.num_blocks[row] + len(block_ids)
        assert end <= self.max_blocks_per_req, f"request needs {end} blocks, the table holds {self.max_blocks_per_req}"
        self.table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def move_row(self, src: int, dst: int) -> None:
        n = self.num_blocks[src]
        self.table[dst, :n] = self.table[src, :n]
        self.num_blocks[dst] = n


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, vocab_size: int,
                 sliding_group: bool = False) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.req_id_to_index: dict[str, int] = {}
        self._holes: list[int] = []  # free rows below num_rows, reused first
        self.num_rows = 0  # rows in use or holes
        # Bumped whenever a row changes request, so per-row settings derived from the rows can be reused until then.
        self.rows_version = 0

        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens_cpu = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_table = BlockTable(max_num_reqs, max_blocks_per_req)
        # The sliding layers' own block table where the KV cache splits in two groups (configs/kv_cache_groups.py).
        self.sliding_block_table = BlockTable(max_num_reqs, max_blocks_per_req) if sliding_group else None

        # Sampling settings per row, as tensors so the sampler reads slices, never Python objects.
        self.temperature = torch.zeros(max_num_reqs, dtype=torch.float32)
        self.top_k = torch.zeros(max_num_reqs, dtype=torch.int64)
        self.top_p = torch.ones(max_num_reqs, dtype=torch.float32)
        self.min_p = torch.zeros(max_num_reqs, dtype=torch.float32)
        self.seeds = torch.zeros(max_num_reqs, dtype=torch.int64)
        self.presence_penalties = torch.zeros(max_num_reqs, dtype=torch.float32)
        self.frequency_penalties = torch.zeros(max_num_reqs, dtype=torch.float32)
        self.repetition_penalties = torch.ones(max_num_reqs, dtype=torch.float32)
        # Python-side settings, checked with numpy so a step loops only over rows that use them.
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)  # -1: no logprobs
        self.has_logit_bias = np.zeros(max_num_reqs, dtype=bool)
        # Each row's adapter id (0: the base model), and the adapters by id (vLLM's request_lora_mapping).
        self.request_lora_mapping = np.zeros(max_num_reqs, dtype=np.int64)
        self.lora_id_to_request: dict[int, LoRARequest] = {}
        self.sampling_params: list[SamplingParams | None] = [None] * max_num_reqs
        self.output_token_ids: list[list[int]] = [[] for _ in range(max_num_reqs)]

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    @property
    def live_req_ids(self) -> list[str]:
        """The requests of rows 0..num_reqs-1 (condensed: none of them a hole)."""
        return cast(list[str], self.req_ids[:self.num_reqs])

    def add_request(self, state: CachedRequestState) -> int:
        assert state.req_id not in self.req_id_to_index, f"request {state.req_id} is already in the batch"
        if self._holes:
            row = self._holes.pop()
        else:
            assert self.num_rows < self.max_num_reqs, "InputBatch is full: max_num_seqs exceeded"
            row = self.num_rows
            self.num_rows += 1
        self.req_ids[row] = state.req_id
        self.req_id_to_index[state.req_id] = row
        self.rows_version += 1

        prompt, output = state.prompt_token_ids, state.output_token_ids
        num_tokens = len(prompt) + len(output)
        assert num_tokens <= self.max_model_len, f"request {state.req_id} has {num_tokens} tokens > max_model_len"
        self.token_ids_cpu[row, : len(prompt)] = prompt
        self.token_ids_cpu[row, len(prompt) : num_tokens] = output
        self.num_tokens[row] = num_tokens
        self.num_prompt_tokens[row] = len(prompt)
        self.num_computed_tokens_cpu[row] = state.num_computed_tokens
        self.block_table.set_row(row, state.block_ids)
        if self.sliding_block_table is not None:
            self.sliding_block_table.set_row(row, state.sliding_block_ids)

        params = state.sampling_params
        assert params.seed is not None, "the engine gives every request a seed before it reaches the runner"
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.seeds[row] = params.seed
        self.presence_penalties[row] = params.presence_penalty
        self.frequency_penalties[row] = params.frequency_penalty
        self.repetition_penalties[row] = params.repetition_penalty
        self.min_tokens[row] = params.min_tokens
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.has_logit_bias[row] = bool(params.logit_bias)
        lora = state.lora_request
        self.request_lora_mapping[row] = 0 if lora is None else lora.lora_int_id
        if lora is not None:
            self.lora_id_to_request[lora.lora_int_id] = lora
        self.sampling_params[row] = params
        # Shared with CachedRequestState so tokens appended by either side are seen by both.
        self.output_token_ids[row] = state.output_token_ids
        return row

    def remove_request(self, req_id: str) -> int | None:
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        self.req_ids[row] = None
        self.rows_version += 1
        self.sampling_params[row] = None
        self.output_token_ids[row] = []
        lora_id = int(self.request_lora_mapping[row])
        self.request_lora_mapping[row] = 0
        if lora_id and not (self.request_lora_mapping == lora_id).any():  # forget adapters no row uses
            del self.lora_id_to_request[lora_id]
        self._holes.append(row)
        # Highest hole last, so add_request reuses the lowest free row first.
        self._holes.sort(reverse=True)
        return row

    def append_token(self, row: int, token_id: int) -> None:
        n = self.num_tokens[row]
        self.token_ids_cpu[row, n] = token_id
        self.num_tokens[row] = n + 1

    def append_sampled(self, rows: np.ndarray, token_ids: list[int]) -> None:
        """Appends token_ids[i] to row rows[i] (distinct rows), to its token ids and its output token ids."""
        num_tokens = self.num_tokens[rows]
        self.token_ids_cpu[rows, num_tokens] = token_ids
        self.num_tokens[rows] = num_tokens + 1
        output_token_ids = self.output_token_ids
        for row, token_id in zip(rows.tolist(), token_ids):
            output_token_ids[row].append(token_id)

    def condense(self) -> None:
        """Move tail rows into holes so the live rows are exactly 0..num_reqs-1."""
        last = self.num_rows - 1
        for hole in sorted(self._holes):
            while last > hole and self.req_ids[last] is None:
                last -= 1
            if last <= hole:
                break
            self._move_row(last, hole)
            last -= 1
        self._holes.clear()
        self.num_rows = self.num_reqs

    def _move_row(self, src: int, dst: int) -> None:
        req_id = self.req_ids[src]
        assert req_id is not None and self.req_ids[dst] is None
        self.req_ids[dst], self.req_ids[src] = req_id, None
        self.rows_version += 1
        self.req_id_to_index[req_id] = dst
        n = self.num_tokens[src]
        self.token_ids_cpu[dst, :n] = self.token_ids_cpu[src, :n]
        for array in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens_cpu, self.min_tokens,
                      self.num_logprobs, self.has_logit_bias, self.request_lora_mapping):
            array[dst] = array[src]
        self.request_lora_mapping[src] = 0  # the free row holds no adapter
        self.block_table.move_row(src, dst)
        if self.sliding_block_table is not None:
            self.sliding_block_table.move_row(src, dst)
        for tensor in (self.temperature, self.top_k, self.top_p, self.min_p, self.seeds,
                       self.presence_penalties, self.frequency_penalties, self.repetition_penalties):
            tensor[dst] = tensor[src]
        self.sampling_params[dst], self.sampling_params[src] = self.sampling_params[src], None
        self.output_token_ids[dst], self.output_token_ids[src] = self.output_token_ids[src], []
