"""SpecDecodeMetadata (vLLM's name and fields): where a step's draft tokens sit in the packed batch and in its
logits.

A sampling request with s drafts schedules s + 1 tokens: its last known token, then the drafts. The logits at those
s + 1 positions are the target's distributions for draft 1..s (the target logits) and for the token after the last
draft (the bonus logits). A request without drafts has one position, its bonus. Logits are computed at these
positions only, request after request: request i owns logits rows [start_i, start_i + s_i].
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from raylm.runner.host_sync import to_device


@dataclass
class SpecDecodeMetadata:
    draft_token_ids: torch.Tensor  # [total drafts] int64, request after request
    draft_token_ids_cpu: np.ndarray  # the same, on the host
    num_draft_tokens: list[int]  # per sampling request, in sampling-row order
    cu_num_draft_tokens: np.ndarray  # [num sampling requests] int64: the end of each request's drafts
    target_logits_indices: torch.Tensor  # [total drafts]: the logits row that verifies each draft
    bonus_logits_indices: torch.Tensor  # [num sampling requests]: the logits row after each request's last draft
    logits_indices: torch.Tensor  # [total drafts + num sampling requests]: the hidden-state rows to compute logits of
    draft_logits_rows: np.ndarray  # [total drafts] int64: the same as target_logits_indices, on the host
    logits_row_starts: np.ndarray  # [num sampling requests] int64: each request's first logits row

    @property
    def num_logits_rows(self) -> int:
        return len(self.draft_logits_rows) + len(self.num_draft_tokens)


def build_spec_decode_metadata(num_draft_tokens: np.ndarray, last_token_index: np.ndarray, draft_token_ids: np.ndarray,
                               device: torch.device) -> SpecDecodeMetadata:
    """`num_draft_tokens` and `last_token_index` (the packed index of each request's last scheduled token) per sampling
    request; `draft_token_ids` all drafts, request after request. Vectorised: no loop over requests."""
    num_draft_tokens = num_draft_tokens.astype(np.int64)
    num_rows = num_draft_tokens + 1
    cu_rows = num_rows.cumsum()
    row_starts = cu_rows - num_rows
    total_rows = int(cu_rows[-1]) if len(cu_rows) else 0
    # Row r of the logits, owned by request i at offset j, is hidden state last_token_index[i] - s_i + j.
    owner = np.repeat(np.arange(len(num_rows)), num_rows)
    offsets = np.arange(total_rows) - row_starts[owner]
    logits_indices = last_token_index[owner] - num_draft_tokens[owner] + offsets
    is_draft_row = offsets < num_draft_tokens[owner]
    draft_rows = np.flatnonzero(is_draft_row)
    bonus_rows = cu_rows - 1

    def on_device(array: np.ndarray) -> torch.Tensor:
        return to_device(torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)), device)

    return SpecDecodeMetadata(
        draft_token_ids=on_device(draft_token_ids),
        draft_token_ids_cpu=np.asarray(draft_token_ids, dtype=np.int64),
        num_draft_tokens=num_draft_tokens.tolist(),
        cu_num_draft_tokens=num_draft_tokens.cumsum(),
        target_logits_indices=on_device(draft_rows),
        bonus_logits_indices=on_device(bonus_rows),
        logits_indices=on_device(logits_indices),
        draft_logits_rows=draft_rows,
        logits_row_starts=row_starts,
    )
