"""Speculative decoding as the scheduler sees it: which draft tokens a request verifies in a step, what the step's
output means for it, and vLLM's acceptance counters.

A decode step of a request with drafts computes 1 + s tokens: its last known token and the s drafts. The scheduler
counts all of them as computed when it schedules (KV slots included) and, when the output says the runner accepted
a - 1 drafts (a tokens came back), moves num_computed_tokens back by the s + 1 - a rejected ones: their KV slots are
the request's next tokens' slots, written again before anything reads them. Only accepted tokens join the request's
tokens, so only they fill prefix-cache blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from raylm.cluster.core.request import Request
from raylm.common.outputs import DRAFT_PLACEHOLDER
from raylm.configs.engine_config import SpeculativeConfig


@dataclass
class SpecDecodingStats:
    """vLLM's counters, since the engine started: steps of a request with drafts (num_drafts), drafts verified,
    drafts accepted, and accepted per draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @classmethod
    def new(cls, num_speculative_tokens: int) -> SpecDecodingStats:
        return cls(num_accepted_tokens_per_pos=[0] * num_speculative_tokens)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                 list(self.num_accepted_tokens_per_pos))

    def minus(self, earlier: SpecDecodingStats) -> SpecDecodingStats:
        """The counts of the interval since `earlier` (a copy of these counters)."""
        per_pos = [now - before for now, before in zip(self.num_accepted_tokens_per_pos,
                                                       earlier.num_accepted_tokens_per_pos, strict=True)]
        return SpecDecodingStats(self.num_drafts - earlier.num_drafts,
                                 self.num_draft_tokens - earlier.num_draft_tokens,
                                 self.num_accepted_tokens - earlier.num_accepted_tokens, per_pos)

    @classmethod
    def total(cls, stats: list[SpecDecodingStats]) -> SpecDecodingStats:
        width = max((len(s.num_accepted_tokens_per_pos) for s in stats), default=0)
        return cls(sum(s.num_drafts for s in stats), sum(s.num_draft_tokens for s in stats),
                   sum(s.num_accepted_tokens for s in stats),
                   [sum(s.num_accepted_tokens_per_pos[i] for s in stats if i < len(s.num_accepted_tokens_per_pos))
                    for i in range(width)])

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a step with drafts yields per request on average: the accepted drafts plus the one sampled after
        them (vLLM's "Mean acceptance length")."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class DraftScheduling:
    """The scheduler's part of speculative decoding, kept out of the scheduler's loop."""

    def __init__(self, config: SpeculativeConfig, async_scheduling: bool, max_model_len: int) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        # A draft model writes the KV of its drafts past the step's tokens: those slots are allocated with the step.
        self.num_lookahead_tokens = config.num_speculative_tokens if config.method == "draft_model" else 0
        self.async_scheduling = async_scheduling
        self.max_model_len = max_model_len
        self.stats = SpecDecodingStats.new(config.num_speculative_tokens)

    def plan(self, request: Request, num_new_tokens: int, budget: int) -> tuple[list[int], int]:
        """The drafts a running request verifies after its `num_new_tokens` regular tokens, and the lookahead slots
        to allocate past them."""
        drafts = self.draft_tokens(request, num_new_tokens, budget)
        return drafts, self.lookahead(request, request.num_computed_tokens + num_new_tokens + len(drafts))

    def draft_tokens(self, request: Request, num_new_tokens: int, budget: int) -> list[int]:
        """The drafts to verify after the request's `num_new_tokens` regular tokens: only in a decode step (its one
        remaining token), capped so that the budget holds, and so that no draft lies past max_tokens or max_model_len
        (one token always follows the accepted drafts). Under async scheduling a request whose last step is still
        out gets placeholders, as many as its last proposal had; a constrained one gets none: its bitmask needs every
        draft, and a placeholder is only known to the runner (its sampling waits for its last step anyway, so every
        step of it would have placeholders)."""
        pending = request.num_tokens + request.num_output_placeholders
        if num_new_tokens != 1 or pending - request.num_computed_tokens != 1:
            return []
        if self.async_scheduling and request.structured_output_request is not None:
            return []
        room = min(budget - num_new_tokens, self.max_model_len - pending - 1,
                   request.max_tokens - (pending - request.num_prompt_tokens) - 1)
        drafts = request.spec_token_ids[: max(room, 0)]
        if self.async_scheduling and request.num_inflight_steps > 0:
            return [DRAFT_PLACEHOLDER] * len(drafts)
        return list(drafts)

    def lookahead(self, request: Request, num_tokens_after: int) -> int:
        """KV slots a draft model may write past `num_tokens_after` (the request's computed plus scheduled tokens);
        none past the request's last possible token."""
        last = request.num_prompt_tokens + request.max_tokens - 1
        return max(0, min(self.num_lookahead_tokens, last - num_tokens_after))

    def verified(self, request: Request, num_draft_tokens: int, num_sampled: int) -> None:
        """A step that verified `num_draft_tokens` drafts of `request` gave `num_sampled` tokens: the rejected
        drafts' positions are not computed after all."""
        num_accepted = num_sampled - 1
        assert 0 <= num_accepted <= num_draft_tokens, (num_sampled, num_draft_tokens)
        request.num_computed_tokens -= num_draft_tokens - num_accepted
        self.stats.observe(num_draft_tokens, num_accepted)
