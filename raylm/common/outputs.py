"""The step contract between the scheduler (cluster/) and the devices (worker/, runner/).

`SchedulerOutput` carries diffs only: requests new to the device, and for requests it already
holds, the new KV blocks and the number of tokens to compute. `ModelRunnerOutput` carries back
what was sampled (and the logprobs asked for); with speculative decoding, several tokens per request (the accepted
drafts and one more) and the next step's proposals.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from raylm.common.kv_transfer import KVConnectorMetadata, KVConnectorOutput
from raylm.common.lora_request import LoRARequest
from raylm.common.pooling_params import PoolingParams
from raylm.common.sampling_params import SamplingParams

# A draft token of `SchedulerOutput.scheduled_spec_decode_tokens` that the runner fills in with its own proposal.
DRAFT_PLACEHOLDER = -1


@dataclass
class NewRequestData:
    """A request the runner has not seen (or one resumed after preemption: all its tokens again)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens already generated (non-empty only when resumed)
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    lora_request: LoRARequest | None = None
    pooling_params: PoolingParams | None = None  # a pooling request (an embedding): pooled once its prompt is done
    # The sliding layers' ids, one per position as block_ids' (configs/kv_cache_groups.py); empty: one group.
    sliding_block_ids: list[int] = field(default_factory=list)


@dataclass
class CachedRequestData:
    """Requests the runner already holds, in parallel lists."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    # Tokens sampled since the last step; needed only by ranks that did not sample them (PP > 1).
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_sliding_block_ids: list[list[int]] = field(default_factory=list)  # empty: one KV cache group


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]  # finished, aborted or preempted: the runner drops them
    # Speculative decoding: the draft tokens to verify, per request that has any (counted in num_scheduled_tokens,
    # after the request's one regular token). DRAFT_PLACEHOLDER: the runner fills in its own latest proposal (async
    # scheduling plans a step before the previous step's proposals are back).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    kv_connector_metadata: KVConnectorMetadata | None = None  # with a kv_connector: this step's transfers

    @classmethod
    def empty(cls) -> SchedulerOutput:
        return cls([], CachedRequestData(), {}, 0, set())


@dataclass
class GrammarOutput:
    """The step's token bitmask (vLLM's name), filled by the engine while the forward runs: one packed row per
    position a constrained request samples (1 + its scheduled drafts), request after request, bit t of a row set
    when token t is allowed."""

    structured_output_request_ids: list[str]
    grammar_bitmask: np.ndarray  # int32 [rows of those requests, ceil(vocab_size / 32)]


@dataclass
class LogprobsLists:
    """Per position: the sampled (or, for prompt logprobs, the actual next prompt) token first, then the top-n,
    each with its logprob; and that first token's rank."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]  # rank of the sampled token in the full distribution (1 = most likely)


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # One list per request in req_ids: [] for a request that did not sample (partial prefill).
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # Whole prompts only, in the step that samples a request's first token: one position per prompt token after
    # the first.
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # Speculative decoding: the draft tokens proposed for each request's next step, in req_ids order; empty when off.
    spec_token_ids: list[list[int]] = field(default_factory=list)
    kv_connector_output: KVConnectorOutput | None = None  # with a kv_connector: transfers finished or failed
    # Pooling requests whose prompt finished this step: the pooled vector (CPU, float32); they sample nothing.
    pooler_output: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def empty(cls) -> ModelRunnerOutput:
        return cls([], [])


@dataclass
class IntermediateTensors:
    """What a non-last pipeline stage hands to the next: {"hidden_states", "residual"}."""

    tensors: dict[str, torch.Tensor]

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self.tensors[key] = value
