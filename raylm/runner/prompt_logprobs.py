"""Prompt logprobs: for each request that asks for them, the logprob of every prompt token given the tokens before
it, with the top-n, taken from the raw logits at the prompt positions of its prefill chunks.

Prompt token i (i >= 1) is scored by the logits at position i - 1, so a chunk computing positions [c, c + s) scores
tokens c + 1 .. min(c + s, P - 1); the logits at the last prompt position sample the first output token instead.
Chunks accumulate here and the whole prompt is handed out in the step that completes it, which is the step that
samples the request's first token.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from raylm.common.outputs import LogprobsLists, NewRequestData
from raylm.runner.input_batch import InputBatch
from raylm.runner.sampler import LogprobsTensors


class PromptLogprobsProcessor:
    def __init__(self, max_positions_per_pass: int) -> None:
        # Logits of at most this many positions exist at once, so a long prompt chunk costs no more memory than
        # the sampler's logits that profile_run measured.
        self.max_positions_per_pass = max_positions_per_pass
        self.num_prompt_logprobs: dict[str, int] = {}  # requests whose prompt is still being scored
        self.in_progress: dict[str, LogprobsLists] = {}
        self.completed: dict[str, LogprobsLists] = {}

    def add_request(self, new: NewRequestData) -> None:
        """Starts scoring a request that asks for prompt logprobs, unless it is resumed after preemption with outputs:
        those were reported with its first token."""
        num_prompt_logprobs = new.sampling_params.prompt_logprobs
        if num_prompt_logprobs is None or new.output_token_ids:
            return
        assert new.num_computed_tokens == 0, "prompt logprobs need every prompt position: no prefix-cache hits"
        self.num_prompt_logprobs[new.req_id] = num_prompt_logprobs
        self.in_progress[new.req_id] = LogprobsLists([], [], [])

    def remove_request(self, req_id: str) -> None:
        self.num_prompt_logprobs.pop(req_id, None)
        self.in_progress.pop(req_id, None)

    def compute(self, hidden_states: torch.Tensor, batch: InputBatch, query_start_loc: np.ndarray,
                compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Scores the prompt positions this step computed; `hidden_states` are the packed ones of the step."""
        if not self.num_prompt_logprobs:
            return
        hidden_index: list[np.ndarray] = []
        target_ids: list[np.ndarray] = []
        spans: list[tuple[str, int]] = []  # (request, number of positions scored), in hidden_index order
        finished: list[str] = []
        for req_id in self.num_prompt_logprobs:
            row = batch.req_id_to_index.get(req_id)
            if row is None:
                continue  # not scheduled this step
            start = int(batch.num_computed_tokens_cpu[row])
            num_prompt_tokens = int(batch.num_prompt_tokens[row])
            end = start + int(query_start_loc[row + 1] - query_start_loc[row])
            num_positions = max(min(end, num_prompt_tokens - 1) - start, 0)
            hidden_index.append(np.arange(num_positions) + query_start_loc[row])
            target_ids.append(batch.token_ids_cpu[row, start + 1 : start + 1 + num_positions])
            spans.append((req_id, num_positions))
            if end >= num_prompt_tokens:
                finished.append(req_id)

        if spans:
            lists = self._score(hidden_states, np.concatenate(hidden_index), np.concatenate(target_ids),
                                max(self.num_prompt_logprobs[req_id] for req_id, _ in spans), compute_logits)
            offset = 0
            for req_id, num_positions in spans:
                positions, num_columns = slice(offset, offset + num_positions), self.num_prompt_logprobs[req_id] + 1
                scored = self.in_progress[req_id]
                scored.token_ids.extend(ids[:num_columns] for ids in lists.token_ids[positions])
                scored.logprobs.extend(values[:num_columns] for values in lists.logprobs[positions])
                scored.ranks.extend(lists.ranks[positions])
                offset += num_positions
        for req_id in finished:
            del self.num_prompt_logprobs[req_id]
            self.completed[req_id] = self.in_progress.pop(req_id)

    def pop_completed(self) -> dict[str, LogprobsLists]:
        completed, self.completed = self.completed, {}
        return completed

    def _score(self, hidden_states: torch.Tensor, hidden_index: np.ndarray, target_ids: np.ndarray,
               num_logprobs: int, compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> LogprobsLists:
        """Every position's target token and top `num_logprobs`, batched over the requests."""
        device = hidden_states.device
        index = torch.from_numpy(hidden_index).to(device, non_blocking=True)
        targets = torch.from_numpy(target_ids).to(device, non_blocking=True)
        result = LogprobsLists([], [], [])
        for lo in range(0, len(index), self.max_positions_per_pass):
            hi = lo + self.max_positions_per_pass
            logprobs = compute_logits(hidden_states[index[lo:hi]]).float().log_softmax(dim=-1)
            tensors = LogprobsTensors.from_logprobs(logprobs, targets[lo:hi], num_logprobs)
            result.token_ids.extend(tensors.token_ids.tolist())
            result.logprobs.extend(tensors.logprobs.tolist())
            result.ranks.extend(tensors.ranks.tolist())
        return result
