"""Logits processors that run on every row (greedy ones too) before sampling: logit bias, min_tokens, penalties.

All work in place on float32 logits [B, V], batched over the rows; Python loops only touch the rows listed in the
metadata's dicts, whose entries reach the device without a host wait (runner/host_sync.py).
"""
from __future__ import annotations

import torch

from raylm.runner.host_sync import to_device
from raylm.runner.sampling_metadata import SamplingMetadata


def apply_logits_processors(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """vLLM's order: logit bias, then min_tokens masking, then repetition, frequency and presence penalties."""
    if metadata.logit_bias:
        apply_logit_bias(logits, metadata.logit_bias)
    if metadata.min_tokens:
        apply_min_tokens(logits, metadata.min_tokens, metadata.output_positions)
    if not metadata.no_penalties:
        assert metadata.prompt_token_ids is not None and metadata.output_token_ids is not None
        apply_penalties(logits, metadata.prompt_token_ids, metadata.output_token_ids, metadata.presence_penalties,
                        metadata.frequency_penalties, metadata.repetition_penalties)
    return logits


def apply_logit_bias(logits: torch.Tensor, logit_bias: dict[int, dict[int, float]]) -> torch.Tensor:
    rows: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for row, bias in logit_bias.items():
        rows.extend([row] * len(bias))
        token_ids.extend(bias.keys())
        biases.extend(bias.values())
    index = _index(rows, token_ids, logits.device)
    return logits.index_put_(index, to_device(torch.tensor(biases, dtype=logits.dtype), logits.device),
                             accumulate=True)


def apply_min_tokens(logits: torch.Tensor, min_tokens: dict[int, tuple[int, set[int]]],
                     output_positions: torch.Tensor) -> torch.Tensor:
    rows: list[int] = []
    token_ids: list[int] = []
    thresholds: list[int] = []
    for row, (min_toks, stop_token_ids) in min_tokens.items():
        rows.extend([row] * len(stop_token_ids))
        token_ids.extend(stop_token_ids)
        thresholds.extend([min_toks] * len(stop_token_ids))
    index = _index(rows, token_ids, logits.device)
    # Decided on the device so that a persistent dict needs no per-step pruning and nothing syncs.
    below = output_positions[index[0]] < to_device(torch.tensor(thresholds, dtype=torch.int64), logits.device)
    return logits.index_put_(index, torch.where(below, float("-inf"), logits[index]))


def apply_penalties(logits: torch.Tensor, prompt_token_ids: torch.Tensor, output_token_ids: torch.Tensor,
                    presence_penalties: torch.Tensor, frequency_penalties: torch.Tensor,
                    repetition_penalties: torch.Tensor) -> torch.Tensor:
    """Repetition (divide positive, multiply negative logits of tokens in the prompt or output), then the OpenAI
    frequency (times the count in the output) and presence (once if in the output) penalties, subtracted.

    Works on the logits of the prompt and output tokens only ([B, P + O], gathered and scattered back), not [B, V]:
    a token listed twice gets the same value computed twice, so the scatter is deterministic."""
    num_rows, vocab_size = logits.shape
    assert prompt_token_ids.shape[0] == num_rows and output_token_ids.shape[0] == num_rows
    # One extra bin takes the padding (id vocab_size).
    output_counts = torch.zeros(num_rows, vocab_size + 1, dtype=logits.dtype, device=logits.device)
    output_counts.scatter_add_(1, output_token_ids, torch.ones_like(output_token_ids, dtype=logits.dtype))

    token_ids = torch.cat([prompt_token_ids, output_token_ids], dim=1)
    is_token = token_ids < vocab_size
    has_token = is_token.any(dim=1, keepdim=True)
    # Padding is pointed at the row's first real token, so it writes back exactly what that token's entry does. A row
    # without tokens points it at column 0 with no repetition penalty; its frequency and presence terms are 0 there.
    first_token = token_ids.gather(1, is_token.to(torch.uint8).argmax(dim=1, keepdim=True))
    token_ids = torch.where(is_token, token_ids, torch.where(has_token, first_token, 0))

    values = logits.gather(1, token_ids)
    repetition = torch.where(has_token, repetition_penalties[:, None], 1.0)
    values = torch.where(values > 0, values / repetition, values * repetition)
    counts = output_counts.gather(1, token_ids)
    values -= frequency_penalties[:, None] * counts + presence_penalties[:, None] * (counts > 0)
    return logits.scatter_(1, token_ids, values)


def _index(rows: list[int], token_ids: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (to_device(torch.tensor(rows, dtype=torch.int64), device),
            to_device(torch.tensor(token_ids, dtype=torch.int64), device))
