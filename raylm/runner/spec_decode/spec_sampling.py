"""SamplingMetadata for the logits rows of a speculative step: request i's s_i + 1 rows (one per draft position and
the bonus) each get the request's settings, as the row that samples output position base_i + j. Penalties see the
drafts before that position as output tokens, min_tokens counts them: row j is exactly what sampling output position
base_i + j would see if drafts 1..j were accepted."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from raylm.runner.host_sync import to_device
from raylm.runner.input_batch import InputBatch
from raylm.runner.sampling_metadata import SamplingMetadata, make_padded_token_ids

# Salts of the counter-based noise (runner/sampler.py), so that a draft's sampling, the accept test and the target's
# resampling at one output position draw independent numbers.
DRAFT_SALT = 0x5DEECE661B873593
ACCEPT_SALT = 0x27D4EB2F165667B1


def expand_sampling_metadata(metadata: SamplingMetadata, num_draft_tokens: list[int], draft_token_ids: np.ndarray,
                             batch: InputBatch, rows: np.ndarray) -> SamplingMetadata:
    """`metadata` has one row per sampling request (batch rows `rows`); the result one per logits row."""
    counts = np.asarray(num_draft_tokens, dtype=np.int64) + 1
    owner_np = np.repeat(np.arange(len(counts)), counts)
    starts = counts.cumsum() - counts
    offsets_np = np.arange(int(counts.sum())) - starts[owner_np]
    device = metadata.temperature.device
    owner = to_device(torch.from_numpy(owner_np), device)
    owners = owner_np.tolist()

    def take(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[owner]

    prompt_ids = output_ids = None
    if not metadata.no_penalties:
        draft_starts = np.concatenate([[0], np.cumsum(num_draft_tokens)])
        outputs: list[list[int]] = []
        for i, row in enumerate(rows.tolist()):
            base = batch.token_ids_cpu[row, batch.num_prompt_tokens[row] : batch.num_tokens[row]].tolist()
            drafts = draft_token_ids[draft_starts[i] : draft_starts[i + 1]].tolist()
            outputs.extend(base + drafts[:j] for j in range(len(drafts) + 1))
        assert metadata.prompt_token_ids is not None
        prompt_ids = metadata.prompt_token_ids[owner]
        output_ids = make_padded_token_ids(outputs, batch.vocab_size, device)
    return replace(
        metadata,
        temperature=metadata.temperature[owner],
        top_k=take(metadata.top_k),
        top_p=take(metadata.top_p),
        min_p=take(metadata.min_p),
        seeds=metadata.seeds[owner],
        output_positions=metadata.output_positions[owner] + to_device(torch.from_numpy(offsets_np), device),
        presence_penalties=metadata.presence_penalties[owner],
        frequency_penalties=metadata.frequency_penalties[owner],
        repetition_penalties=metadata.repetition_penalties[owner],
        prompt_token_ids=prompt_ids,
        output_token_ids=output_ids,
        min_tokens={r: metadata.min_tokens[i] for r, i in enumerate(owners) if i in metadata.min_tokens},
        logit_bias={r: metadata.logit_bias[i] for r, i in enumerate(owners) if i in metadata.logit_bias},
    )
