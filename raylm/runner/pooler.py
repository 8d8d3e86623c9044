"""Pooling requests (embeddings) on the device: each one's hidden states become one vector once its prompt is
computed, in the same forward as the batch's generation requests (vLLM v1's pooler, with the pooling type carried by
each request's PoolingParams rather than fixed per model, so that one engine serves both).

A prompt may be computed over several steps (chunked prefill): MEAN keeps a running sum of the chunks done and CLS
the first token's state, so nothing of a chunk's hidden states outlives its step. A preempted request is told
finished and comes back new: its partial state starts again with it."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from raylm.common.outputs import SchedulerOutput
from raylm.common.pooling_params import PoolingParams
from raylm.runner.input_batch import InputBatch


class Pooler:
    def __init__(self) -> None:
        self.params: dict[str, PoolingParams] = {}  # the pooling requests the runner holds
        self.partial: dict[str, torch.Tensor] = {}  # MEAN: the sum so far; CLS: the first token's state

    def update(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.params.pop(req_id, None)
            self.partial.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            if new.pooling_params is not None:
                self.params[new.req_id] = new.pooling_params

    def pool(self, hidden_states: torch.Tensor, batch: InputBatch, query_start_loc: np.ndarray,
             sampling_rows: np.ndarray) -> tuple[dict[str, torch.Tensor], np.ndarray]:
        """The pooled vector (on the device, float32) of each pooling request whose prompt ends this step, and the
        mask over `sampling_rows` of the rows that do sample (every row but those). Call before the next step: the
        rows are this step's."""
        keep = np.ones(len(sampling_rows), dtype=bool)
        if not self.params:
            return {}, keep
        pooled: dict[str, torch.Tensor] = {}
        finishing = {int(row): i for i, row in enumerate(sampling_rows.tolist())}
        for row, req_id in enumerate(batch.live_req_ids):
            params = self.params.get(req_id)
            if params is None:
                continue
            start, end = int(query_start_loc[row]), int(query_start_loc[row + 1])
            states = hidden_states[start:end].float()
            if params.pooling_type == "MEAN":
                chunk_sum = states.sum(dim=0)
                previous = self.partial.get(req_id)
                self.partial[req_id] = chunk_sum if previous is None else previous + chunk_sum
            elif params.pooling_type == "CLS" and batch.num_computed_tokens_cpu[row] == 0:
                self.partial[req_id] = states[0]
            index = finishing.get(row)
            if index is None:
                continue  # a partial prefill
            keep[index] = False
            if params.pooling_type == "LAST":
                vector = states[-1]
            elif params.pooling_type == "MEAN":
                vector = self.partial.pop(req_id) / int(batch.num_prompt_tokens[row])
            else:
                vector = self.partial.pop(req_id)
            pooled[req_id] = finish_vector(vector, params)
        return pooled, keep


def finish_vector(vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """Matryoshka truncation, then normalisation (vLLM's order: the kept prefix is normalised)."""
    if params.dimensions is not None:
        vector = vector[:params.dimensions]
    return F.normalize(vector, p=2, dim=-1) if params.normalize else vector
