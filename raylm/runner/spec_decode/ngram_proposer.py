"""ngram (prompt lookup) drafts: find the longest suffix of a request's tokens, between prompt_lookup_min and
prompt_lookup_max tokens long, that occurred earlier in its tokens (prompt and output), and propose the tokens that
followed its earliest occurrence. vLLM's rule; transformers' prompt lookup takes the same earliest match.

Vectorised over the batch and the context: one [requests, context] comparison per n-gram length, no Python loop over
tokens.
"""
from __future__ import annotations

import numpy as np

from raylm.runner.spec_decode.proposer import Proposals, ProposeInputs, Proposer


class NgramProposer(Proposer):
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        assert 1 <= prompt_lookup_min <= prompt_lookup_max
        self.k, self.min_n, self.max_n = num_speculative_tokens, prompt_lookup_min, prompt_lookup_max

    def propose(self, inputs: ProposeInputs) -> Proposals:
        batch, rows = inputs.batch, inputs.sampling_rows
        lengths = batch.num_tokens[rows].astype(np.int64)
        drafts = propose_ngram(batch.token_ids_cpu[rows, : int(lengths.max()) if len(rows) else 0], lengths,
                               self.min_n, self.max_n, np.minimum(inputs.max_num_drafts, self.k))
        return Proposals(drafts)


def propose_ngram(tokens: np.ndarray, lengths: np.ndarray, min_n: int, max_n: int,
                  max_drafts: np.ndarray) -> list[list[int]]:
    """tokens [R, W] (row r's tokens are its first lengths[r]); per row at most max_drafts[r] tokens proposed."""
    num_rows, width = tokens.shape
    if num_rows == 0 or width < 2:
        return [[] for _ in range(num_rows)]
    ends = np.arange(width - 1)  # where an earlier occurrence ends; at least one token must follow it
    rows = np.arange(num_rows)
    # match[r, e]: the last n tokens up to e equal row r's last n tokens (n grows each round).
    match = ends[None, :] <= (lengths - 2)[:, None]
    best_len = np.zeros(num_rows, dtype=np.int64)
    best_end = np.zeros(num_rows, dtype=np.int64)
    for n in range(1, max_n + 1):
        start = ends - (n - 1)
        suffix_token = tokens[rows, np.maximum(lengths - n, 0)]
        match &= (start >= 0)[None, :] & (tokens[:, np.maximum(start, 0)] == suffix_token[:, None])
        match &= (lengths >= n)[:, None]
        found = match.any(axis=1)
        if not found.any():
            break  # no longer suffix can match where this one did not
        if n < min_n:
            continue
        best_len = np.where(found, n, best_len)
        best_end = np.where(found, match.argmax(axis=1), best_end)  # argmax: the earliest occurrence
    counts = np.where(best_len > 0, np.minimum(max_drafts, lengths - 1 - best_end), 0)
    counts = np.maximum(counts, 0)
    return [tokens[r, best_end[r] + 1 : best_end[r] + 1 + counts[r]].tolist() for r in range(num_rows)]
