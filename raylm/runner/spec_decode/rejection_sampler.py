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

Like the sampler, it reads nothing back until its end (runner/host_sync.py): the decisions are taken on the device
over a [requests, max drafts + 1] matrix (vLLM's layout, -1 past a request's last token), and that matrix and the
logprobs come back with one wait. Index tensors come from the step's host-side metadata.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from raylm.common.outputs import LogprobsLists
from raylm.common.sampling_params import _GREEDY_EPS
from raylm.runner.host_sync import to_device, to_host
from raylm.runner.penalties import apply_logits_processors
from raylm.runner.sampler import LogprobsTensors, Sampler, apply_top_k_top_p_min_p, gumbel_max_sample, random_uniform
from raylm.runner.sampling_metadata import SamplingMetadata
from raylm.runner.spec_decode.metadata import SpecDecodeMetadata
from raylm.runner.spec_decode.spec_sampling import ACCEPT_SALT

PLACEHOLDER_TOKEN_ID = -1  # vLLM's name: an output matrix entry past a request's last token


@dataclass
class RejectionSamplerOutput:
    token_ids: list[list[int]]  # per sampling request: the accepted drafts, then one more token
    logprobs: list[LogprobsLists | None] | None  # per sampling request, one position per token; None: none asked


class RejectionSampler:
    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata, spec: SpecDecodeMetadata,
                 draft_probs: torch.Tensor | None = None,
                 num_logprobs: list[int | None] | None = None) -> RejectionSamplerOutput:
        """`logits` [rows, vocab] float32 (consumed) and `metadata` per logits row (spec_sampling.py);
        `draft_probs` [drafts, vocab]: the q of each draft, NaN rows for one-hot drafts (None: all one-hot);
        `num_logprobs` per request."""
        assert logits.shape[0] == spec.num_logits_rows == metadata.temperature.shape[0]
        layout = MatrixLayout(spec, logits.device)
        output, tensors = self.verify(logits, metadata, spec.draft_token_ids, layout, draft_probs)
        if tensors is None:
            (output_cpu,) = to_host(output)  # the step's one host wait
            return RejectionSamplerOutput(_token_lists(output_cpu.numpy()), None)
        assert num_logprobs is not None
        output_cpu, ids, values, ranks = to_host(output, tensors.token_ids, tensors.logprobs, tensors.ranks)
        token_ids = _token_lists(output_cpu.numpy())
        return RejectionSamplerOutput(token_ids, _logprobs_lists(ids.tolist(), values.tolist(), ranks.tolist(),
                                                                 spec.logits_row_starts.tolist(), token_ids,
                                                                 num_logprobs))

    @staticmethod
    def verify(logits: torch.Tensor, metadata: SamplingMetadata, drafts: torch.Tensor, layout: MatrixLayout,
               draft_probs: torch.Tensor | None) -> tuple[torch.Tensor, LogprobsTensors | None]:
        """The device part: the output matrix [requests, max drafts + 1] and, when asked, every logits row's
        logprobs of the token emitted at that row (rows past a request's last token: discarded later)."""
        raw_logprobs = None if metadata.max_num_logprobs is None else logits.log_softmax(dim=-1)
        apply_logits_processors(logits, metadata)
        draft_rows = layout.draft_rows
        target_probs = None
        if draft_probs is not None:  # before sampling, which consumes the logits
            target_probs = _probs(logits[draft_rows], metadata, draft_rows)
        candidates = Sampler.sample(logits, metadata)

        recovered = candidates[draft_rows]
        accepted = recovered == drafts
        if target_probs is not None:
            assert draft_probs is not None
            from_q = ~torch.isnan(draft_probs[:, 0])
            accepted_q, recovered_q = _accept_or_resample(
                target_probs, draft_probs.nan_to_num(0.0), drafts, metadata.seeds[draft_rows],
                metadata.output_positions[draft_rows])
            accepted = torch.where(from_q, accepted_q, accepted)
            recovered = torch.where(from_q, recovered_q, recovered)

        output = layout.output_token_ids(accepted, drafts, recovered, candidates[layout.bonus_rows])
        if raw_logprobs is None:
            return output, None
        assert metadata.max_num_logprobs is not None
        row_tokens = output.view(-1)[layout.row_cells].clamp(min=0)
        return output, LogprobsTensors.from_logprobs(raw_logprobs, row_tokens, metadata.max_num_logprobs)


class MatrixLayout:
    """Where each draft and each logits row sits in the [requests, max drafts + 1] output matrix, flattened (host
    arithmetic on the step's counts, copied to the device once)."""

    def __init__(self, spec: SpecDecodeMetadata, device: torch.device) -> None:
        counts = np.asarray(spec.num_draft_tokens, dtype=np.int64)
        self.num_reqs = len(counts)
        self.width = (int(counts.max()) if self.num_reqs else 0) + 1
        rows_per_req = counts + 1
        owner = np.repeat(np.arange(self.num_reqs), rows_per_req)
        column = np.arange(int(rows_per_req.sum())) - spec.logits_row_starts[owner]
        cells = owner * self.width + column
        is_draft = column < counts[owner]
        self.draft_rows, self.bonus_rows = spec.target_logits_indices, spec.bonus_logits_indices
        self.draft_cells = to_device(torch.from_numpy(cells[is_draft]), device)
        self.bonus_cells = to_device(torch.from_numpy(np.arange(self.num_reqs) * self.width + counts), device)
        self.row_cells = to_device(torch.from_numpy(cells), device)

    def output_token_ids(self, accepted: torch.Tensor, drafts: torch.Tensor, recovered: torch.Tensor,
                         bonus: torch.Tensor) -> torch.Tensor:
        """[requests, width] int64: the accepted drafts, then the recovered token at the first rejection (or the
        bonus token after the last draft), then PLACEHOLDER_TOKEN_ID."""
        shape, device = (self.num_reqs, self.width), accepted.device
        accepted_matrix = torch.zeros(self.num_reqs * self.width, dtype=torch.int64, device=device)
        accepted_matrix.index_copy_(0, self.draft_cells, accepted.to(torch.int64))
        num_accepted = accepted_matrix.view(shape).cumprod(dim=1).sum(dim=1, keepdim=True)
        draft_matrix = torch.full((self.num_reqs * self.width,), PLACEHOLDER_TOKEN_ID, dtype=torch.int64,
                                  device=device).index_copy_(0, self.draft_cells, drafts)
        last_matrix = torch.zeros_like(draft_matrix).index_copy_(0, self.draft_cells, recovered)
        last_matrix.index_copy_(0, self.bonus_cells, bonus)
        columns = torch.arange(self.width, device=device)[None, :]
        placeholder = torch.full_like(draft_matrix.view(shape), PLACEHOLDER_TOKEN_ID)
        return torch.where(columns < num_accepted, draft_matrix.view(shape),
                           torch.where(columns == num_accepted, last_matrix.view(shape), placeholder))


def _probs(logits: torch.Tensor, metadata: SamplingMetadata, rows: torch.Tensor) -> torch.Tensor:
    """The target's sampling distribution at `rows`: temperature, then top-k, top-p, min-p. Rows of greedy requests
    (never drafted from a distribution) divide by 1, their result unused."""
    temperature = metadata.temperature[rows]
    logits.div_(temperature.where(temperature >= _GREEDY_EPS, 1.0)[:, None])

    def take(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[rows]

    apply_top_k_top_p_min_p(logits, take(metadata.top_k), take(metadata.top_p), take(metadata.min_p),
                            metadata.max_top_k)
    return logits.softmax(dim=-1)


def _accept_or_resample(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, seeds: torch.Tensor,
                        positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The standard rule for drafts sampled from q: accept iff u * q(d) <= p(d); else draw from (p - q)+."""
    p_draft = p.gather(1, drafts[:, None]).squeeze(1)
    q_draft = q.gather(1, drafts[:, None]).squeeze(1)
    u = random_uniform(seeds ^ ACCEPT_SALT, positions, 1).squeeze(1)
    accepted = u * q_draft <= p_draft
    residual = (p - q).clamp_(min=0.0)
    # A rejected draft has p(d) < q(d), so some mass is left; rounding aside, when none is, p itself is the answer.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p, residual)
    return accepted, gumbel_max_sample(residual.log(), seeds, positions)


def _token_lists(output: np.ndarray) -> list[list[int]]:
    return [row[row != PLACEHOLDER_TOKEN_ID].tolist() for row in output]


def _logprobs_lists(ids: list[list[int]], values: list[list[float]], ranks: list[int], row_starts: list[int],
                    token_ids: list[list[int]], num_logprobs: list[int | None]) -> list[LogprobsLists | None]:
    """Per request, the logprobs rows of its emitted tokens (its first len(tokens) logits rows), cut to n + 1."""
    lists: list[LogprobsLists | None] = []
    for start, tokens, n in zip(row_starts, token_ids, num_logprobs):
        end = start + len(tokens)
        lists.append(None if n is None else LogprobsLists([row[: n + 1] for row in ids[start:end]],
                                                          [row[: n + 1] for row in values[start:end]],
                                                          ranks[start:end]))
    return lists
