"""What the sampler needs for one step: per-row settings as batched tensors, built by the ModelRunner.

Row i of every tensor and the keys of the dicts refer to row i of the logits. Tensors live on the logits' device.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from raylm.runner.host_sync import to_device


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float32; 0 (below SamplingParams' greedy cutoff): greedy
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [B] int64, 0: off for that row; None: off for every row
    top_p: torch.Tensor | None  # [B] float32, 1.0: off for that row; None: off for every row
    min_p: torch.Tensor | None  # [B] float32, 0.0: off for that row; None: off for every row
    seeds: torch.Tensor  # [B] int64: the user's seed or one the engine drew
    output_positions: torch.Tensor  # [B] int64: tokens generated so far, i.e. the index of the token being sampled
    max_num_logprobs: int | None  # None: no row wants logprobs
    no_penalties: bool
    presence_penalties: torch.Tensor  # [B] float32, 0.0: off
    frequency_penalties: torch.Tensor  # [B] float32, 0.0: off
    repetition_penalties: torch.Tensor  # [B] float32, 1.0: off
    # [B, max_len] int64 padded with vocab_size, an extra bin the penalties drop (see make_padded_token_ids).
    # Needed only when no_penalties is False.
    prompt_token_ids: torch.Tensor | None = None
    output_token_ids: torch.Tensor | None = None
    # row -> (min_tokens, stop token ids incl. EOS): while output_positions[row] < min_tokens the stop tokens get -inf.
    # Rows that have reached min_tokens may stay: they are left alone.
    min_tokens: dict[int, tuple[int, set[int]]] = field(default_factory=dict)
    logit_bias: dict[int, dict[int, float]] = field(default_factory=dict)  # row -> {token id: bias added to its logit}
    # The largest top-k of the rows (off counts as the vocabulary size), known on the host: a partial sort of that
    # many logits instead of a full one. None: read from top_k where that is free (CPU), else a full sort.
    max_top_k: int | None = None

    def __post_init__(self) -> None:
        assert self.temperature.dim() == 1, "temperature must be [num_rows]"
        assert self.no_penalties or (self.prompt_token_ids is not None and self.output_token_ids is not None), \
            "penalties need prompt_token_ids and output_token_ids"


def make_padded_token_ids(token_ids: Sequence[Sequence[int] | np.ndarray], pad_id: int,
                          device: torch.device | str | None = None) -> torch.Tensor:
    """[len(token_ids), longest] int64, each row left-aligned and padded with pad_id (vocab_size for the penalties)."""
    lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.int64)
    max_len = int(lengths.max()) if len(token_ids) else 0
    padded = torch.full((len(token_ids), max_len), pad_id, dtype=torch.int64)
    if max_len:
        padded.masked_scatter_(torch.arange(max_len) < lengths[:, None],
                               torch.cat([torch.as_tensor(ids, dtype=torch.int64) for ids in token_ids]))
    return to_device(padded, device) if device is not None else padded
