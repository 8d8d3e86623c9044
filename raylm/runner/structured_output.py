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
                          row_req_ids: Sequence[str]) -> None:
    """Masks, in place, the rows of logits [num_sampling_rows, vocab] float32 whose request (row_req_ids, in logits
    order) has a bitmask row (bit t set: token t allowed); other rows are left as they are. Columns past the bitmask's
    32 x width (a model vocabulary larger than the tokenizer's) are forbidden in the masked rows."""
    if grammar_output is None or not grammar_output.structured_output_request_ids:
        return
    ids = grammar_output.structured_output_request_ids
    packed = grammar_output.grammar_bitmask
    if list(row_req_ids) == ids:  # every row constrained, in order (the common case): no gather
        indices = list(range(len(ids)))
    else:
        logits_row = {req_id: i for i, req_id in enumerate(row_req_ids)}
        full = np.full((logits.shape[0], packed.shape[1]), -1, dtype=np.int32)  # -1: every bit set
        for j, req_id in enumerate(ids):
            if req_id in logits_row:
                full[logits_row[req_id]] = packed[j]
        indices = sorted(logits_row[req_id] for req_id in ids if req_id in logits_row)
        if not indices:
            return
        packed = full
    covered = min(logits.shape[1], packed.shape[1] * _BITS)
    bitmask = torch.from_numpy(np.ascontiguousarray(packed)).to(logits.device, non_blocking=True)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=covered,
                                         indices=None if len(indices) == logits.shape[0] else indices)
    if covered < logits.shape[1]:
        logits[indices, covered:] = float("-inf")
