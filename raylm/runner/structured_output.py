"""The grammar bitmask on the logits: tokens a request's grammar forbids get -inf before any other sampling step, so
penalties, temperature, top-k/p and the logprobs all see the constrained distribution (as vLLM reports them).

xgrammar's kernel applies the packed bits in place (C++ on CPU, CUDA / Triton on GPUs): on a 2-core CPU about ten
times faster than unpacking them into a boolean mask for torch's masked_fill_."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xgrammar

from raylm.common.outputs import GrammarOutput

_BITS = 32


def apply_grammar_bitmask(logits: torch.Tensor, grammar_output: GrammarOutput | None,
                          row_req_ids: Sequence[str], num_draft_tokens: Sequence[int] | None = None) -> None:
    """Masks, in place, the rows of logits [num_logits_rows, vocab] float32 whose request (row_req_ids, in logits
    order) has bitmask rows (bit t set: token t allowed); other rows are left as they are. With speculative decoding
    (`num_draft_tokens`, per request of row_req_ids) request i owns 1 + num_draft_tokens[i] consecutive logits rows
    (its drafts' target rows, then its bonus row), and as many bitmask rows, in the same order. Columns past the
    bitmask's 32 x width (a model vocabulary larger than the tokenizer's) are forbidden in the masked rows."""
    if grammar_output is None or not grammar_output.structured_output_request_ids:
        return
    ids = grammar_output.structured_output_request_ids
    packed = grammar_output.grammar_bitmask
    counts = [1] * len(row_req_ids) if num_draft_tokens is None else [1 + n for n in num_draft_tokens]
    if list(row_req_ids) == ids:  # every row constrained, in order (the common case): no gather
        indices = list(range(logits.shape[0]))
    else:
        starts = np.cumsum([0, *counts[:-1]])
        logits_rows = {req_id: (int(starts[i]), counts[i]) for i, req_id in enumerate(row_req_ids)}
        full = np.full((logits.shape[0], packed.shape[1]), -1, dtype=np.int32)  # -1: every bit set
        indices, grammar_row = [], 0
        for req_id in ids:
            if req_id not in logits_rows:  # not sampling here: one row, as it has no drafts to count
                assert num_draft_tokens is None, f"{req_id}: bitmask rows for a request without logits rows"
                grammar_row += 1
                continue
            start, count = logits_rows[req_id]
            full[start : start + count] = packed[grammar_row : grammar_row + count]
            indices.extend(range(start, start + count))
            grammar_row += count
        if not indices:
            return
        indices.sort()
        packed = full
    assert packed.shape[0] == logits.shape[0], "one bitmask row per logits row"
    covered = min(logits.shape[1], packed.shape[1] * _BITS)
    bitmask = torch.from_numpy(np.ascontiguousarray(packed)).to(logits.device, non_blocking=True)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=covered,
                                         indices=None if len(indices) == logits.shape[0] else indices)
    if covered < logits.shape[1]:
        logits[indices, covered:] = float("-inf")
