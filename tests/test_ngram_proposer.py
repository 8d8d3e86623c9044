"""The vectorised ngram proposer against transformers' prompt lookup (PromptLookupCandidateGenerator: the earliest
occurrence of the longest matching suffix) and against a plain-Python statement of vLLM's rule with a minimum
n-gram length, on random token rows with many repeats, batched with rows of different lengths."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from raylm.runner.spec_decode.ngram_proposer import propose_ngram


def reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The longest suffix of n in [min_n, max_n] tokens found earlier (its occurrence followed by a token), and the
    up to k tokens after its earliest occurrence."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        for start in range(length - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def random_rows(seed: int, num_rows: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 48, size=num_rows)
    tokens = np.zeros((num_rows, 48), dtype=np.int64)
    for row, length in enumerate(lengths):
        tokens[row, :length] = rng.integers(0, vocab, size=length)
    return tokens, lengths


@pytest.mark.parametrize(("vocab", "max_n", "k"), [(3, 2, 3), (5, 3, 5), (4, 5, 1), (20, 4, 4)])
def test_matches_transformers_prompt_lookup(vocab: int, max_n: int, k: int) -> None:
    tokens, lengths = random_rows(vocab * 10 + max_n, 64, vocab)
    ours = propose_ngram(tokens, lengths, 1, max_n, np.full(len(lengths), k))
    for row, length in enumerate(lengths):
        generator = PromptLookupCandidateGenerator(num_output_tokens=k, max_matching_ngram_size=max_n, max_length=1000)
        input_ids = torch.tensor([tokens[row, :length].tolist()])
        candidates, _ = generator.get_candidates(input_ids)
        assert ours[row] == candidates[0, length:].tolist(), (tokens[row, :length], ours[row])


@pytest.mark.parametrize(("min_n", "max_n"), [(2, 3), (3, 3), (2, 5)])
def test_minimum_length_and_caps(min_n: int, max_n: int) -> None:
    tokens, lengths = random_rows(min_n * 7 + max_n, 64, 3)
    caps = np.random.default_rng(1).integers(0, 6, size=len(lengths))
    ours = propose_ngram(tokens, lengths, min_n, max_n, caps)
    for row, length in enumerate(lengths):
        assert ours[row] == reference(tokens[row, :length].tolist(), min_n, max_n, int(caps[row]))


def test_no_match_and_short_rows() -> None:
    tokens = np.array([[1, 2, 3, 4], [5, 0, 0, 0], [7, 7, 0, 0]])
    assert propose_ngram(tokens, np.array([4, 1, 2]), 1, 3, np.array([3, 3, 3])) == [[], [], [7]]
