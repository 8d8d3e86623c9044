"""SamplingMetadata from the InputBatch rows that sample, and logprobs back to per-request lists.

Everything is read from the batch's per-row tensors and numpy arrays; Python loops touch only the
rows that use min_tokens or logit_bias."""
from __future__ import annotations

import numpy as np
import torch

from runner.input_batch import InputBatch
from runner.outputs import LogprobsLists
from runner.sampler import LogprobsTensors
from runner.sampling_metadata import SamplingMetadata, make_padded_token_ids
from runner.sampling_params import _GREEDY_EPS


def make_sampling_metadata(batch: InputBatch, rows: np.ndarray, eos_token_ids: tuple[int, ...],
                           device: torch.device) -> SamplingMetadata:
    num_rows = len(rows)
    every_row = num_rows == batch.num_reqs  # rows are sorted, so this means rows == 0..num_reqs-1
    index = torch.from_numpy(rows)

    def take(t: torch.Tensor) -> torch.Tensor:
        return (t[:num_rows] if every_row else t[index]).to(device, non_blocking=True)

    temperature = take(batch.temperature)
    greedy = temperature < _GREEDY_EPS
    # No row samples in a step of partial prefills only: that counts as all greedy, never as both.
    all_greedy = bool(greedy.all())
    all_random = not all_greedy and not bool(greedy.any())
    top_k, top_p, min_p = take(batch.top_k), take(batch.top_p), take(batch.min_p)
    output_positions_np = batch.num_tokens[rows].astype(np.int64) - batch.num_prompt_tokens[rows]
    presence, frequency = take(batch.presence_penalties), take(batch.frequency_penalties)
    repetition = take(batch.repetition_penalties)
    no_penalties = not (bool(presence.any()) or bool(frequency.any()) or bool((repetition != 1.0).any()))
    num_logprobs = batch.num_logprobs[rows]
    max_num_logprobs = int(num_logprobs.max()) if num_rows and num_logprobs.max() >= 0 else None

    prompt_ids = output_ids = None
    if not no_penalties:
        prompt_ids = make_padded_token_ids(
            [batch.token_ids_cpu[r, : batch.num_prompt_tokens[r]] for r in rows], batch.vocab_size, device)
        output_ids = make_padded_token_ids(
            [batch.token_ids_cpu[r, batch.num_prompt_tokens[r] : batch.num_tokens[r]] for r in rows],
            batch.vocab_size, device)

    min_tokens = {}
    for i in np.flatnonzero(batch.min_tokens[rows] > output_positions_np).tolist():
        params = batch.sampling_params[rows[i]]
        assert params is not None
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        min_tokens[i] = (params.min_tokens, stops)
    logit_bias = {}
    for i in np.flatnonzero(batch.has_logit_bias[rows]).tolist():
        params = batch.sampling_params[rows[i]]
        assert params is not None and params.logit_bias
        logit_bias[i] = {int(token): float(bias) for token, bias in params.logit_bias.items()}

    return SamplingMetadata(
        temperature=temperature,
        all_greedy=all_greedy,
        all_random=all_random,
        top_k=None if all_greedy or not bool(top_k.any()) else top_k,
        top_p=None if all_greedy or not bool((top_p < 1.0).any()) else top_p,
        min_p=None if all_greedy or not bool(min_p.any()) else min_p,
        seeds=take(batch.seeds),
        output_positions=torch.from_numpy(output_positions_np).to(device, non_blocking=True),
        max_num_logprobs=max_num_logprobs,
        no_penalties=no_penalties,
        presence_penalties=presence,
        frequency_penalties=frequency,
        repetition_penalties=repetition,
        prompt_token_ids=prompt_ids,
        output_token_ids=output_ids,
        min_tokens=min_tokens,
        logit_bias=logit_bias,
    )


def to_logprobs_lists(batch: InputBatch, rows: np.ndarray,
                      logprobs: LogprobsTensors | None) -> dict[str, LogprobsLists]:
    if logprobs is None:
        return {}
    per_row = [None if n < 0 else int(n) for n in batch.num_logprobs[rows]]
    lists = logprobs.tolists(per_row)
    return {batch.req_ids[row]: entry for row, entry in zip(rows.tolist(), lists) if entry is not None}
