"""Logits processors that run on every row (greedy ones too) before sampling: logit bias, min_tokens, penalties.

All work in place on float32 logits [B, V], batched over the rows; Python loops only touch the rows listed in the
metadata's dicts.
"""
from __future__ import annotations

import torch

from runner.sampling_metadata import SamplingMetadata


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
    return logits.index_put_(index, torch.tensor(biases, dtype=logits.dtype, device=logits.device), accumulate=True)


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
    below = output_positions[index[0]] < torch.tensor(thresholds, dtype=torch.int64, device=logits.device)
    return logits.index_put_(index, torch.where(below, float("-inf"), logits[index]))


def apply_penalties(logits: torch.Tensor, prompt_token_ids: torch.Tensor, output_token_ids: torch.Tensor,
                    presence_penalties: torch.Tensor, frequency_penalties: torch.Tensor,
                    repetition_penalties: torch.Tensor) -> torch.Tensor:
    """Repetition (divide positive, multiply negative logits of tokens in the prompt or output), then the OpenAI
    frequency (times the count in the output) and presence (once if in the output) penalties, subtracted."""
    num_rows, vocab_size = logits.shape
    assert prompt_token_ids.shape[0] == num_rows and output_token_ids.shape[0] == num_rows
    # One extra bin takes the padding (id vocab_size) and is dropped.
    output_counts = torch.zeros(num_rows, vocab_size + 1, dtype=logits.dtype, device=logits.device)
    output_counts.scatter_add_(1, output_token_ids, torch.ones_like(output_token_ids, dtype=logits.dtype))
    output_counts = output_counts[:, :vocab_size]
    in_output = output_counts > 0
    in_prompt = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=logits.device)
    in_prompt = in_prompt.scatter_(1, prompt_token_ids, True)[:, :vocab_size]

    scale = torch.where(in_prompt | in_output, repetition_penalties[:, None], 1.0)
    torch.where(logits > 0, logits / scale, logits * scale, out=logits)
    logits -= frequency_penalties[:, None] * output_counts
    logits -= presence_penalties[:, None] * in_output
    return logits


def _index(rows: list[int], token_ids: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(token_ids, dtype=torch.int64, device=device))
