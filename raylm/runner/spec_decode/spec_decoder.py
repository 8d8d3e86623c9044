"""The ModelRunner's speculative decoding, one step at a time.

Before the forward (`prepare_drafts`): each request's scheduled drafts are written into its token row after its
known tokens, where input packing gathers them like any token (placeholders, under async scheduling, take this
runner's own latest proposal). After the forward (`sample`): the rejection sampler picks the accepted drafts and one
more token, the batch rows get them, and the proposer drafts every sampling request's next step. The runner keeps
each request's num_computed_tokens itself: under async scheduling the scheduler plans a step before it knows how
many drafts the previous one accepted, and counts them all.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from raylm.common.outputs import DRAFT_PLACEHOLDER, LogprobsLists, SchedulerOutput
from raylm.configs import EngineConfig
from raylm.runner.attention.backend import AttentionBackend
from raylm.runner.host_sync import to_host
from raylm.runner.input_batch import InputBatch
from raylm.runner.sampler import Sampler
from raylm.runner.sampling_inputs import to_logprobs_lists
from raylm.runner.sampling_metadata import SamplingMetadata
from raylm.runner.spec_decode.metadata import SpecDecodeMetadata
from raylm.runner.spec_decode.ngram_proposer import NgramProposer
from raylm.runner.spec_decode.proposer import ProposeInputs, Proposer
from raylm.runner.spec_decode.rejection_sampler import RejectionSampler
from raylm.runner.spec_decode.spec_sampling import expand_sampling_metadata


@dataclass
class SpecStepOutput:
    sampled_token_ids: list[list[int]]  # per batch row ([] for a partial prefill)
    logprobs: dict[str, LogprobsLists]
    spec_token_ids: list[list[int]]  # per batch row: the proposal for its next step


def make_proposer(config: EngineConfig, attn_backend: AttentionBackend, dtype: torch.dtype,
                  device: torch.device) -> Proposer:
    spec = config.speculative_config
    assert spec is not None
    if spec.method == "ngram":
        assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None, "resolve the config first"
        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    from raylm.runner.spec_decode.draft_model_proposer import DraftModelProposer

    assert config.resolved.draft_model_info is not None
    return DraftModelProposer(config, config.resolved.draft_model_info, attn_backend, dtype, device)


class SpecDecoder:
    def __init__(self, config: EngineConfig, attn_backend: AttentionBackend, dtype: torch.dtype,
                 device: torch.device) -> None:
        spec = config.speculative_config
        assert spec is not None and config.model_config.max_model_len is not None
        self.k = spec.num_speculative_tokens
        self.max_model_len = config.model_config.max_model_len
        self.async_scheduling = config.scheduler_config.async_scheduling
        self.proposer = make_proposer(config, attn_backend, dtype, device)
        self.rejection_sampler = RejectionSampler()
        self.sampler = Sampler()
        self.proposals: dict[str, list[int]] = {}  # each request's latest drafts
        self.draft_probs: dict[str, torch.Tensor] = {}  # ...and their q, where sampled from a distribution
        self.num_computed: dict[str, int] = {}  # what this runner knows each request's KV holds
        # This step's, from prepare_drafts to sample: per batch row.
        self._step_start = np.zeros(0, dtype=np.int64)
        self._num_scheduled = np.zeros(0, dtype=np.int64)
        self._draft_probs: torch.Tensor | None = None

    def remove_request(self, req_id: str) -> None:
        self.proposals.pop(req_id, None)
        self.draft_probs.pop(req_id, None)
        self.num_computed.pop(req_id, None)

    def correct_num_computed(self, req_id: str, scheduled: int) -> int:
        """The computed tokens of a request the runner holds: the scheduler's count less the drafts of in-flight
        steps it counted and this runner rejected (none without async scheduling)."""
        known = self.num_computed.get(req_id, scheduled)
        assert known <= scheduled and (self.async_scheduling or known == scheduled), (req_id, known, scheduled)
        return known

    def prepare_drafts(self, scheduler_output: SchedulerOutput, batch: InputBatch) -> np.ndarray:
        """Write the step's drafts into their rows; returns the drafts per batch row."""
        num_reqs = batch.num_reqs
        self._step_start = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        scheduled = scheduler_output.num_scheduled_tokens
        self._num_scheduled = np.array([scheduled[r] for r in batch.live_req_ids], dtype=np.int64)
        num_drafts = np.zeros(num_reqs, dtype=np.int64)
        q_rows: list[tuple[int, torch.Tensor | None, int]] = []  # (row, q, drafts) in row order
        for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            row = batch.req_id_to_index[req_id]
            if drafts[0] == DRAFT_PLACEHOLDER:
                drafts = self._own_drafts(req_id, len(drafts), batch, row)
            n = int(batch.num_tokens[row])
            batch.token_ids_cpu[row, n : n + len(drafts)] = drafts
            num_drafts[row] = len(drafts)
            q_rows.append((row, self.draft_probs.get(req_id), len(drafts)))
        self._draft_probs = _stack_draft_probs(sorted(q_rows, key=lambda entry: entry[0]))
        return num_drafts

    def sample(self, logits: torch.Tensor, spec: SpecDecodeMetadata | None, rows: np.ndarray, batch: InputBatch,
               metadata: SamplingMetadata, hidden_states: torch.Tensor | None) -> SpecStepOutput:
        """Verify (or, with no drafts this step, sample), append the tokens, propose the next drafts."""
        num_reqs = batch.num_reqs
        if spec is None:
            sampler_output = self.sampler(logits, metadata)
            tokens = [[t] for t in to_host(sampler_output.sampled_token_ids)[0].tolist()]  # the step's one wait
            logprobs = to_logprobs_lists(batch, rows, sampler_output.logprobs_tensors)
        else:
            expanded = expand_sampling_metadata(metadata, spec.num_draft_tokens, spec.draft_token_ids_cpu, batch,
                                                rows)
            per_row = [None if n < 0 else int(n) for n in batch.num_logprobs[rows]]
            out = self.rejection_sampler(logits, expanded, spec, self._draft_probs, per_row)
            tokens = out.token_ids
            logprobs = {} if out.logprobs is None else {
                batch.req_ids[row]: entry for row, entry in zip(rows.tolist(), out.logprobs) if entry is not None}
        rejected = np.zeros(num_reqs, dtype=np.int64)
        sampled: list[list[int]] = [[] for _ in range(num_reqs)]
        for i, row in enumerate(rows.tolist()):
            for token in tokens[i]:
                batch.append_token(row, token)
            batch.output_token_ids[row].extend(tokens[i])
            sampled[row] = tokens[i]
            rejected[row] = (spec.num_draft_tokens[i] if spec is not None else 0) + 1 - len(tokens[i])
        step_end = self._step_start + self._num_scheduled - rejected
        batch.num_computed_tokens_cpu[:num_reqs] = step_end
        req_ids = batch.req_ids[:num_reqs]
        for row, req_id in enumerate(req_ids):
            assert req_id is not None
            self.num_computed[req_id] = int(step_end[row])
        return SpecStepOutput(sampled, logprobs, self._propose(batch, rows, step_end, metadata, hidden_states))

    def _propose(self, batch: InputBatch, rows: np.ndarray, step_end: np.ndarray, metadata: SamplingMetadata,
                 hidden_states: torch.Tensor | None) -> list[list[int]]:
        max_drafts = np.minimum(np.maximum(self.max_model_len - 1 - batch.num_tokens[rows].astype(np.int64), 0), self.k)
        proposals = self.proposer.propose(ProposeInputs(batch, rows, max_drafts, self._step_start, step_end,
                                                        metadata, hidden_states))
        spec_token_ids: list[list[int]] = [[] for _ in range(batch.num_reqs)]
        for i, row in enumerate(rows.tolist()):
            req_id = batch.req_ids[row]
            assert req_id is not None
            spec_token_ids[row] = self.proposals[req_id] = proposals.token_ids[i]
            probs = None if proposals.probs is None else proposals.probs[i]
            if probs is None:
                self.draft_probs.pop(req_id, None)
            else:
                self.draft_probs[req_id] = probs
        return spec_token_ids

    def _own_drafts(self, req_id: str, count: int, batch: InputBatch, row: int) -> list[int]:
        """This runner's latest proposal for the request, cut or padded to `count`: a padding draft is any token
        (here the last one), verified like the rest; it only costs compute."""
        drafts = self.proposals.get(req_id, [])[:count]
        filler = drafts[-1] if drafts else int(batch.token_ids_cpu[row, batch.num_tokens[row] - 1])
        return drafts + [filler] * (count - len(drafts))


def _stack_draft_probs(rows: list[tuple[int, torch.Tensor | None, int]]) -> torch.Tensor | None:
    """[drafts, vocab]: each draft's q, a NaN row where the draft is one-hot (no q, or a padding draft)."""
    probs = [q for _, q, _ in rows if q is not None]
    if not probs:
        return None
    vocab, like = probs[0].shape[-1], probs[0]
    parts = []
    for _, q, count in rows:
        q = q[:count] if q is not None else like.new_empty(0, vocab)
        parts.append(q)
        if len(q) < count:
            parts.append(like.new_full((count - len(q), vocab), float("nan")))
    return torch.cat(parts)
