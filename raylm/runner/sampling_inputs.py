"""SamplingMetadata from the InputBatch rows that sample, and logprobs back to per-request lists.

Everything is read from the batch's per-row tensors and numpy arrays; Python loops touch only the
rows that use min_tokens or logit_bias. What depends only on the sampling rows' SamplingParams is
kept while those rows hold the same requests, which is most decode steps."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from raylm.common.outputs import LogprobsLists
from raylm.common.sampling_params import _GREEDY_EPS
from raylm.runner.host_sync import to_device
from raylm.runner.input_batch import InputBatch
from raylm.runner.sampler import LogprobsTensors
from raylm.runner.sampling_metadata import SamplingMetadata, make_padded_token_ids


@dataclass
class _RowSettings:
    """The part of SamplingMetadata that follows from the sampling rows' requests alone."""

    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    max_top_k: int | None
    seeds: torch.Tensor
    max_num_logprobs: int | None
    no_penalties: bool
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    min_tokens: dict[int, tuple[int, set[int]]]  # every row with min_tokens > 0; filtered by position each step
    logit_bias: dict[int, dict[int, float]]


class SamplingMetadataBuilder:
    """Builds each step's SamplingMetadata, reusing the row settings while the batch's rows and the sampling rows
    are those of the previous step."""

    def __init__(self, eos_token_ids: tuple[int, ...], device: torch.device) -> None:
        self.eos_token_ids = eos_token_ids
        self.device = device
        self._settings: _RowSettings | None = None
        self._rows_version = -1
        self._rows = np.empty(0, dtype=np.int64)

    def build(self, batch: InputBatch, rows: np.ndarray) -> SamplingMetadata:
        every_row = len(rows) == batch.num_reqs  # rows are sorted, so this means rows == 0..num_reqs-1
        settings = self._settings
        if settings is None or batch.rows_version != self._rows_version or not np.array_equal(rows, self._rows):
            settings = self._settings = _row_settings(batch, rows, every_row, self.eos_token_ids, self.device)
            self._rows_version, self._rows = batch.rows_version, rows

        if every_row:
            num_rows = len(rows)
            output_positions_np = batch.num_tokens[:num_rows].astype(np.int64) - batch.num_prompt_tokens[:num_rows]
        else:
            output_positions_np = batch.num_tokens[rows].astype(np.int64) - batch.num_prompt_tokens[rows]
        prompt_ids = output_ids = None
        if not settings.no_penalties:
            prompt_ids = make_padded_token_ids(
                [batch.token_ids_cpu[r, : batch.num_prompt_tokens[r]] for r in rows], batch.vocab_size, self.device)
            output_ids = make_padded_token_ids(
                [batch.token_ids_cpu[r, batch.num_prompt_tokens[r] : batch.num_tokens[r]] for r in rows],
                batch.vocab_size, self.device)
        min_tokens = {i: entry for i, entry in settings.min_tokens.items() if entry[0] > output_positions_np[i]}

        return SamplingMetadata(
            temperature=settings.temperature,
            all_greedy=settings.all_greedy,
            all_random=settings.all_random,
            top_k=settings.top_k,
            top_p=settings.top_p,
            min_p=settings.min_p,
            max_top_k=settings.max_top_k,
            seeds=settings.seeds,
            output_positions=to_device(torch.from_numpy(output_positions_np), self.device),
            max_num_logprobs=settings.max_num_logprobs,
            no_penalties=settings.no_penalties,
            presence_penalties=settings.presence,
            frequency_penalties=settings.frequency,
            repetition_penalties=settings.repetition,
            prompt_token_ids=prompt_ids,
            output_token_ids=output_ids,
            min_tokens=min_tokens,
            logit_bias=settings.logit_bias,
        )


def _row_settings(batch: InputBatch, rows: np.ndarray, every_row: bool, eos_token_ids: tuple[int, ...],
                  device: torch.device) -> _RowSettings:
    num_rows = len(rows)
    index = torch.from_numpy(rows)

    def take(t: torch.Tensor) -> torch.Tensor:
        return t[:num_rows] if every_row else t[index]

    # Decided on the batch's CPU copies: on the device each decision would be a read back to the host.
    temperature, top_k, top_p, min_p = take(batch.temperature), take(batch.top_k), take(batch.top_p), take(batch.min_p)
    presence, frequency = take(batch.presence_penalties), take(batch.frequency_penalties)
    repetition = take(batch.repetition_penalties)
    greedy = temperature < _GREEDY_EPS
    # No row samples in a step of partial prefills only: that counts as all greedy, never as both.
    all_greedy = bool(greedy.all())
    all_random = not all_greedy and not bool(greedy.any())
    no_penalties = not (bool(presence.any()) or bool(frequency.any()) or bool((repetition != 1.0).any()))
    vocab_size = batch.vocab_size
    max_top_k = int(top_k.masked_fill((top_k <= 0) | (top_k > vocab_size), vocab_size).max()) if num_rows else None
    num_logprobs = batch.num_logprobs[rows]
    max_num_logprobs = int(num_logprobs.max()) if num_rows and num_logprobs.max() >= 0 else None

    min_tokens = {}
    for i in np.flatnonzero(batch.min_tokens[rows] > 0).tolist():
        params = batch.sampling_params[rows[i]]
        assert params is not None
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        min_tokens[i] = (params.min_tokens, stops)
    logit_bias = {}
    for i in np.flatnonzero(batch.has_logit_bias[rows]).tolist():
        params = batch.sampling_params[rows[i]]
        assert params is not None and params.logit_bias
        logit_bias[i] = {int(token): float(bias) for token, bias in params.logit_bias.items()}

    return _RowSettings(
        temperature=to_device(temperature, device),
        all_greedy=all_greedy,
        all_random=all_random,
        top_k=None if all_greedy or not bool(top_k.any()) else to_device(top_k, device),
        top_p=None if all_greedy or not bool((top_p < 1.0).any()) else to_device(top_p, device),
        min_p=None if all_greedy or not bool(min_p.any()) else to_device(min_p, device),
        max_top_k=max_top_k,
        seeds=to_device(take(batch.seeds), device),
        max_num_logprobs=max_num_logprobs,
        no_penalties=no_penalties,
        presence=to_device(presence, device),
        frequency=to_device(frequency, device),
        repetition=to_device(repetition, device),
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
