"""One step's token budget: `max_num_batched_tokens` for every token, and a smaller share for prompt tokens while the
step also decodes.

A step is as long as the tokens it computes, and every running stream waits for the whole step before its next token.
A prompt computed beside running decodes therefore sets their inter-token latency: on CPU, where a step's time grows
with its tokens from a few dozen on, one 256-token prompt stalls eight decoding streams for the whole prompt's time.
`max_prefill_tokens_with_decodes` bounds the prompt tokens such a step takes (the chunk), so decodes wait at most one
chunk's time; a step with no decode gives prompts the whole budget, since nobody waits on it. vLLM's
`long_prefill_token_threshold` bounds one request's prompt tokens per step instead, whatever else runs.
"""
from __future__ import annotations

from raylm.cluster.core.request import Request


class StepBudget:
    def __init__(self, max_num_batched_tokens: int, long_prefill_token_threshold: int,
                 max_prefill_tokens_with_decodes: int, running: list[Request]) -> None:
        self.tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold
        # Decided before any request is scheduled: a prompt ahead of a decode in `running` must see the cap too.
        decoding = max_prefill_tokens_with_decodes and any(not is_prefill(r) for r in running)
        self.prefill_tokens = max_prefill_tokens_with_decodes if decoding else max_num_batched_tokens

    def grant(self, num_new_tokens: int, prefill: bool) -> int:
        """How many of a request's `num_new_tokens` it may compute this step (0: none)."""
        threshold = self.long_prefill_token_threshold
        if threshold:
            num_new_tokens = min(num_new_tokens, threshold)
        if prefill:
            num_new_tokens = min(num_new_tokens, self.prefill_tokens)
        return max(0, min(num_new_tokens, self.tokens))

    def take(self, num_tokens: int, prefill: bool) -> None:
        self.tokens -= num_tokens
        if prefill:
            self.prefill_tokens -= num_tokens

    def give_back(self, num_tokens: int, prefill: bool) -> None:
        """A request scheduled earlier in the step was preempted: its tokens are free again."""
        self.take(-num_tokens, prefill)


def is_prefill(request: Request) -> bool:
    """The request computes more than its next token: a prompt (or its rest), or a preempted request's recompute."""
    return request.num_tokens + request.num_output_placeholders - request.num_computed_tokens > 1
