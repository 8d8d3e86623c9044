"""The rejection sampler: which drafts a step accepts, and the token after them, so that the output is distributed
exactly as sampling the target one token at a time.

Each logits row j of a request (draft position j, or the bonus after the last draft) first gets the token the target
would sample there: the argmax for greedy requests, else the Gumbel-max draw with the request's counter-based noise
for output position base + j (runner/sampler.py), the very draw sampling without drafts makes.

- One-hot drafts (ngram; greedy drafting): draft j is accepted iff it equals that token. This is the standard rule
  for a draft distribution q = one-hot(d): accepted with probability p(d), and on rejection the token is drawn from
  p without d, i.e. from (p - q)+ renormalised. Seeded requests therefore give the same tokens as without drafts.
- Drafts sampled from a distribution q (a draft model, random requests): accepted iff u * q(d) <= p(d) with u
  uniform (its own salted noise); on rejection the token is drawn from (p - q)+ renormalised.
Greedy requests accept while the draft equals the target's argmax. The first rejected position ends the request's
tokens; if none is rejected, the bonus row's token follows the last draft.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from raylm.common.outputs import LogprobsLists
from raylm.runner.penalties import apply_logits_processors
from raylm.runner.sampler import LogprobsTensors, Sampler, apply_top_k_top_p_min_p, gumbel_max_sample, random_uniform
from raylm.runner.sampling_metadata import SamplingMetadata
from raylm.runner.spec_decode.metadata import SpecDecodeMetadata
from raylm.runner.spec_decode.spec_sampling import ACCEPT_SALT


@dataclass
class RejectionSamplerOutput:
    token_ids: list[list[int]]  # per sampling request: the accepted drafts, then one more token
    logprobs: list[LogprobsLists | None] | None  # per sampling request, one position per token; None: none asked


class RejectionSampler:
    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata, spec: SpecDecodeMetadata,
                 draft_token_ids: np.ndarray, draft_probs: torch.Tensor | None = None,
                 num_logprobs: list[int | None] | None = None) -> RejectionSamplerOutput:
        """`logits` [rows, vocab] float32 (consumed) and `metadata` per logits row (spec_sampling.py);
        `draft_token_ids` the drafts on the host; `draft_probs` [drafts, vocab]: the q of each draft, NaN rows for
        one-hot drafts (None: all one-hot); `num_logprobs` per request."""
        assert logits.shape[0] == spec.num_logits_rows == metadata.temperature.shape[0]
        raw_logprobs = None if metadata.max_num_logprobs is None else logits.log_softmax(dim=-1)
        apply_logits_processors(logits, metadata)
        draft_rows = spec.draft_logits_rows
        sampled_from_q = np.zeros(len(draft_rows), dtype=bool)
        target_probs = None
        if draft_probs is not None:
            sampled_from_q = ~torch.isnan(draft_probs[:, 0]).cpu().numpy()
            q_rows = torch.from_numpy(draft_rows[sampled_from_q]).to(logits.device)
            target_probs = _probs(logits[q_rows].clone(), metadata, q_rows) if len(q_rows) else None
        candidates = Sampler.sample(logits, metadata).cpu().numpy()

        accepted = candidates[draft_rows] == draft_token_ids
        recovered = candidates[draft_rows].copy()
        if target_probs is not None:
            assert draft_probs is not None
            q_index = np.flatnonzero(sampled_from_q)
            q_rows = torch.from_numpy(draft_rows[q_index]).to(logits.device)
            accepted[q_index], recovered[q_index] = _accept_or_resample(
                target_probs, draft_probs[torch.from_numpy(q_index).to(logits.device)],
                torch.from_numpy(draft_token_ids[q_index]).to(logits.device), metadata.seeds[q_rows],
                metadata.output_positions[q_rows])

        num_accepted = _num_leading_accepted(accepted, spec.num_draft_tokens)
        token_ids: list[list[int]] = []
        emitted_rows: list[int] = []
        draft_start = 0
        for i, (num_drafts, start) in enumerate(zip(spec.num_draft_tokens, spec.logits_row_starts.tolist())):
            m = int(num_accepted[i])
            last = recovered[draft_start + m] if m < num_drafts else candidates[start + num_drafts]
            token_ids.append([*draft_token_ids[draft_start : draft_start + m].tolist(), int(last)])
            emitted_rows.extend(range(start, start + m + 1))
            draft_start += num_drafts
        if raw_logprobs is None:
            return RejectionSamplerOutput(token_ids, None)
        assert metadata.max_num_logprobs is not None and num_logprobs is not None
        return RejectionSamplerOutput(token_ids, _logprobs_lists(raw_logprobs, emitted_rows, token_ids,
                                                                 metadata.max_num_logprobs, num_logprobs))


def _probs(logits: torch.Tensor, metadata: SamplingMetadata, rows: torch.Tensor) -> torch.Tensor:
    """The target's sampling distribution at `rows` (random requests): temperature, then top-k, top-p, min-p."""
    logits.div_(metadata.temperature[rows][:, None])

    def take(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[rows]

    apply_top_k_top_p_min_p(logits, take(metadata.top_k), take(metadata.top_p), take(metadata.min_p))
    return logits.softmax(dim=-1)


def _accept_or_resample(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, seeds: torch.Tensor,
                        positions: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The standard rule for drafts sampled from q: accept iff u * q(d) <= p(d); else draw from (p - q)+."""
    p_draft = p.gather(1, drafts[:, None]).squeeze(1)
    q_draft = q.gather(1, drafts[:, None]).squeeze(1)
    u = random_uniform(seeds ^ ACCEPT_SALT, positions, 1).squeeze(1)
    accepted = u * q_draft <= p_draft
    residual = (p - q).clamp_(min=0.0)
    # A rejected draft has p(d) < q(d), so some mass is left; rounding aside, when none is, p itself is the answer.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p, residual)
    resampled = gumbel_max_sample(residual.log(), seeds, positions)
    return accepted.cpu().numpy(), resampled.cpu().numpy()


def _num_leading_accepted(accepted: np.ndarray, num_draft_tokens: list[int]) -> np.ndarray:
    """Per request, how many drafts are accepted before its first rejection (vectorised over a padded matrix)."""
    counts = np.asarray(num_draft_tokens, dtype=np.int64)
    width = int(counts.max()) if len(counts) else 0
    if width == 0:
        return np.zeros(len(counts), dtype=np.int64)
    padded = np.zeros((len(counts), width), dtype=bool)
    padded[np.arange(width)[None, :] < counts[:, None]] = accepted
    return np.cumprod(padded, axis=1).sum(axis=1)


def _logprobs_lists(raw_logprobs: torch.Tensor, emitted_rows: list[int], token_ids: list[list[int]],
                    max_num_logprobs: int, num_logprobs: list[int | None]) -> list[LogprobsLists | None]:
    """The logprobs of every emitted token (from the raw logits of its row) with the top-n, per request."""
    rows = torch.tensor(emitted_rows, dtype=torch.int64, device=raw_logprobs.device)
    tokens = torch.tensor([t for tokens in token_ids for t in tokens], dtype=torch.int64, device=raw_logprobs.device)
    tensors = LogprobsTensors.from_logprobs(raw_logprobs[rows], tokens, max_num_logprobs)
    ids, values, ranks = tensors.token_ids.tolist(), tensors.logprobs.tolist(), tensors.ranks.tolist()
    lists: list[LogprobsLists | None] = []
    start = 0
    for tokens_of_request, n in zip(token_ids, num_logprobs):
        end = start + len(tokens_of_request)
        lists.append(None if n is None else LogprobsLists([row[: n + 1] for row in ids[start:end]],
                                                          [row[: n + 1] for row in values[start:end]],
                                                          ranks[start:end]))
        start = end
    return lists
