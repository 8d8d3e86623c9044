"""The grammar bitmask on the logits: tokens a request's grammar forbids get -inf before any other sampling step, so
penalties, temperature, top-k/p and the logprobs all see the constrained distribution (as vLLM reports them)."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from raylm.common.outputs import GrammarOutput

_BITS = 32


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [R, W] packed rows -> bool [R, vocab_size]; columns past W * 32 (a model vocabulary larger than the
    tokenizer's) are forbidden."""
    shifts = torch.arange(_BITS, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    return torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)


def apply_grammar_bitmask(logits: torch.Tensor, grammar_output: GrammarOutput | None,
                          row_req_ids: Sequence[str]) -> None:
    """Masks, in place, the rows of logits [num_sampling_rows, vocab] float32 whose request (row_req_ids, in logits
    order) has a bitmask row; other rows are left as they are."""
    if grammar_output is None or not grammar_output.structured_output_request_ids:
        return
    logits_row = {req_id: i for i, req_id in enumerate(row_req_ids)}
    pairs = [(logits_row[req_id], j) for j, req_id in enumerate(grammar_output.structured_output_request_ids)
             if req_id in logits_row]
    if not pairs:
        return
    rows = torch.tensor([row for row, _ in pairs], device=logits.device)
    bitmask = torch.from_numpy(grammar_output.grammar_bitmask[[j for _, j in pairs]]).to(logits.device)
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    logits[rows] = logits[rows].masked_fill_(~allowed, float("-inf"))
