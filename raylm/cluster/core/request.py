"""A request's state inside the engine core: its tokens, how far the KV cache has caught up, and
why it finished."""
from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from raylm.common.lora_request import LoRARequest
from raylm.common.pooling_params import PoolingParams
from raylm.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from raylm.cluster.core.structured_output.request import StructuredOutputRequest


# What a pooling request carries where every request's sampling settings are read: it never samples.
POOLING_SAMPLING_PARAMS = SamplingParams(max_tokens=1, seed=0)


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()  # blocks allocated, its KV arriving through a KV connector
    WAITING_FOR_FSM = enum.auto()  # its grammar is still compiling (vLLM's name)
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Every status after PREEMPTED is a finished one.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()  # the client went away, or the engine shut down
    FINISHED_ERROR = enum.auto()  # the server failed it (e.g. its grammar); `stop_reason` holds the message

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence. `num_computed_tokens` counts tokens whose KV is computed (or scheduled to be:
    the scheduler advances it when it schedules) and catches up to `num_tokens`."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: set[int] | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = set(eos_token_ids or ())
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority  # smaller is served first (vLLM's convention)
        self.lora_request = lora_request  # None: the base model
        # A pooling request (an embedding) computes its prompt and finishes with the pooled hidden state; it samples
        # nothing (its sampling_params are POOLING_SAMPLING_PARAMS, read by the parts that read every request's).
        self.pooling_params = pooling_params

        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        # Set by the scheduler on admission: sampling_params.max_tokens capped by max_model_len.
        self.max_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None

        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hits at first schedule; -1 until then
        # Hashes of the request's full blocks of known tokens, filled lazily by the KV cache manager.
        self.block_hashes: list[bytes] = []

        # Scheduler bookkeeping.
        self.num_output_placeholders = 0  # async scheduling: scheduled samples whose token is not back yet
        self.num_inflight_steps = 0  # scheduled steps whose output has not come back
        self.num_stale_steps = 0  # of those, steps scheduled before the last preemption (ignored)
        self.num_sent_tokens = 0  # token ids the runner has been sent (for send_token_ids)
        self.num_preemptions = 0
        # Speculative decoding: the runner's proposal for the next step (drafts of the tokens after the last one).
        self.spec_token_ids: list[int] = []
        # Set by the StructuredOutputManager when sampling_params.structured_outputs asks for a grammar.
        self.structured_output_request: StructuredOutputRequest | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def get_finished_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, num_tokens={self.num_tokens}, "
                f"num_computed_tokens={self.num_computed_tokens})")
