"""Turns engine-core outputs into the RequestOutputs users see: text, stop strings, logprobs and n > 1.

A request with n > 1 reaches the engine core as n child requests; here they are gathered back into one
parent RequestOutput holding one CompletionOutput per child, ordered by index.
"""
from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast

from raylm.cluster.core.engine_core_output import EngineCoreOutput
from raylm.cluster.engine.detokenizer import IncrementalDetokenizer
from raylm.cluster.engine.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestOutput
from raylm.common.outputs import LogprobsLists
from raylm.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# "cumulative": every output carries the full text and tokens so far; "delta": only what is new since the
# previous output (for streaming); "final": only the finished output, as "cumulative" would give it (offline use,
# where building the intermediate outputs would be wasted work).
RequestOutputKind = Literal["cumulative", "delta", "final"]


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput | PoolingRequestOutput] = field(default_factory=list)
    # Requests that hit a stop string: the engine core must abort them to free their blocks.
    reqs_to_abort: list[str] = field(default_factory=list)


@dataclass
class ParentRequest:
    """What the user sees as one request: a single sequence, or n child sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    child_ids: dict[int, str] = field(default_factory=dict)  # index -> child request id
    unfinished_child_ids: set[str] = field(default_factory=set)
    # Latest cumulative completion per index, so that every output can list all n.
    completions: dict[int, CompletionOutput] = field(default_factory=dict)
    num_cached_tokens: int = 0
    # Set when they arrive (from one child); under "delta" cleared once sent.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    kv_transfer_params: dict[str, Any] | None = None  # from the engine's KV connector as the request finished
    first_token_time: float | None = None  # time.monotonic() as its first token (of any child) arrived

    @property
    def finished(self) -> bool:
        return not self.unfinished_child_ids

    def unfinished_children(self) -> list[str]:
        return [self.child_ids[i] for i in sorted(self.child_ids) if self.child_ids[i] in self.unfinished_child_ids]


@dataclass
class RequestState:
    """One sequence the engine core generates."""

    request_id: str
    parent: ParentRequest
    index: int
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, float]] | None  # None: not requested
    stop_token_ids: frozenset[int]  # EOS and the request's stop_token_ids


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: Collection[int] | None = None) -> None:
        """`eos_token_ids`: the tokens that stop a request as EOS (the tokenizer's EOS when None)."""
        self.tokenizer = tokenizer
        if eos_token_ids is None:
            eos_token_ids = () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
        self.eos_token_ids = frozenset(eos_token_ids)
        # Single-token texts shared by the detokenizers, one memo per skip_special_tokens setting.
        self._token_texts: dict[bool, dict[int, str]] = {True: {}, False: {}}
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}
        # Pooling requests: nothing to detokenize, one output as they finish (their prompt token ids kept for it).
        self.pooling_requests: dict[str, list[int]] = {}

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states or self.pooling_requests)

    def add_pooling_request(self, request_id: str, prompt_token_ids: list[int]) -> None:
        if request_id in self.request_states or request_id in self.pooling_requests:
            raise ValueError(f"Request {request_id} already exists")
        self.pooling_requests[request_id] = list(prompt_token_ids)

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        parent_id: str | None = None,
        index: int = 0,
        output_kind: RequestOutputKind = "cumulative",
    ) -> None:
        """Registers one engine-core request; for n > 1 call once per child with the shared parent_id."""
        if request_id in self.request_states:
            raise ValueError(f"Request {request_id} already exists")
        parent_request_id = request_id if parent_id is None else parent_id
        parent = self.parent_requests.get(parent_request_id)
        if parent is None:
            parent = ParentRequest(parent_request_id, prompt, list(prompt_token_ids), output_kind)
            self.parent_requests[parent_request_id] = parent
        if index in parent.child_ids:
            raise ValueError(f"Request {parent_request_id} already has a child with index {index}")
        parent.child_ids[index] = request_id
        parent.unfinished_child_ids.add(request_id)
        parent.completions[index] = CompletionOutput(index=index, text="", token_ids=[])
        detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            prompt_token_ids,
            skip_special_tokens=sampling_params.skip_special_tokens,
            stop=cast(list[str], sampling_params.stop),  # SamplingParams.__post_init__ made it a list
            include_stop_str_in_output=sampling_params.include_stop_str_in_output,
            token_texts=self._token_texts[sampling_params.skip_special_tokens],
        )
        logprobs: list[dict[int, float]] | None = [] if sampling_params.logprobs is not None else None
        stop_token_ids = self.eos_token_ids.union(sampling_params.stop_token_ids)
        self.request_states[request_id] = RequestState(request_id, parent, index, detokenizer, logprobs,
                                                       stop_token_ids)

    def parent_ids(self, child_ids: list[str]) -> list[str]:
        """The user-facing request ids of engine-core requests (a child of n > 1 maps to its parent)."""
        states = self.request_states
        return list(dict.fromkeys(states[c].parent.request_id for c in child_ids if c in states))

    def abort_request(self, request_id: str) -> list[str]:
        """Drops a request's state; returns the engine-core request ids to abort (all children of a parent)."""
        if self.pooling_requests.pop(request_id, None) is not None:
            return [request_id]
        parent = self.parent_requests.pop(request_id, None)
        if parent is not None:
            child_ids = parent.unfinished_children()
            for child_id in child_ids:
                del self.request_states[child_id]
            return child_ids
        state = self.request_states.pop(request_id, None)
        if state is None:
            return []
        self._finish_child(state)
        return [request_id]

    def process_outputs(self, engine_core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        processed = ProcessedOutputs()
        # Parent id -> (parent, completions new in this step); one RequestOutput per parent per step.
        changed: dict[str, tuple[ParentRequest, list[CompletionOutput]]] = {}
        request_states = self.request_states
        for engine_core_output in engine_core_outputs:
            if engine_core_output.request_id in self.pooling_requests:
                processed.request_outputs.append(self._pooling_output(engine_core_output))
                continue
            state = request_states.get(engine_core_output.request_id)
            if state is None:
                continue  # aborted while the step ran
            parent = state.parent
            if engine_core_output.new_prompt_logprobs is not None:
                parent.prompt_logprobs = [None, *_logprobs_dicts(engine_core_output.new_prompt_logprobs)]
            completion = self._update_request(state, engine_core_output, processed.reqs_to_abort)
            if completion is None:
                continue
            if parent.output_kind != "delta":
                parent.completions[state.index] = completion
            entry = changed.get(parent.request_id)
            if entry is None:
                changed[parent.request_id] = (parent, [completion])
            else:
                entry[1].append(completion)
            if completion.finish_reason is not None:
                del request_states[state.request_id]
                self._finish_child(state)

        for parent, completions in changed.values():
            kind = parent.output_kind
            if kind == "final" and not parent.finished:
                continue  # other children of this parent are still running
            prompt_logprobs = parent.prompt_logprobs
            if kind == "delta":
                outputs = sorted(completions, key=lambda c: c.index) if len(completions) > 1 else completions
                parent.prompt_logprobs = None
            else:
                outputs = [parent.completions[i] for i in sorted(parent.completions)]
            processed.request_outputs.append(
                RequestOutput(
                    request_id=parent.request_id,
                    prompt=parent.prompt,
                    prompt_token_ids=parent.prompt_token_ids,
                    outputs=outputs,
                    finished=parent.finished,
                    num_cached_tokens=parent.num_cached_tokens,
                    prompt_logprobs=prompt_logprobs,
                    kv_transfer_params=parent.kv_transfer_params,
                    first_token_time=parent.first_token_time,
                )
            )
        return processed

    def _update_request(
        self, state: RequestState, engine_core_output: EngineCoreOutput, reqs_to_abort: list[str]
    ) -> CompletionOutput | None:
        """Detokenizes the new tokens; returns this step's completion, or None when nothing changed or, under
        "final", the request is not finished."""
        detokenizer = state.detokenizer
        if state.parent.first_token_time is None and engine_core_output.new_token_ids:
            state.parent.first_token_time = time.monotonic()
        num_tokens_before = detokenizer.num_output_tokens
        new_token_ids = engine_core_output.new_token_ids
        # A "stop" on an EOS or stop_token_ids token (not a grammar's end on a content token): its text is left out.
        stop_terminated = (engine_core_output.finish_reason == "stop" and bool(new_token_ids)
                           and new_token_ids[-1] in state.stop_token_ids)
        stop_str = detokenizer.update(new_token_ids, stop_terminated)
        # A stop string drops the tokens after the one completing it.
        num_new_tokens = (len(new_token_ids) if stop_str is None
                          else detokenizer.num_output_tokens - num_tokens_before)

        finish_reason, stop_reason = engine_core_output.finish_reason, engine_core_output.stop_reason
        error = None
        if finish_reason == "error":  # the engine's message, kept apart from what a stop is
            error, stop_reason = str(stop_reason), None
        if stop_str is not None:
            finish_reason, stop_reason, error = "stop", stop_str, None
            if engine_core_output.finish_reason is None:
                reqs_to_abort.append(state.request_id)
        if num_new_tokens == 0 and finish_reason is None:
            return None

        new_logprobs: list[dict[int, float]] | None = None
        if state.logprobs is not None:
            new_logprobs = _logprobs_dicts(engine_core_output.new_logprobs, num_new_tokens)
            state.logprobs.extend(new_logprobs)
        parent = state.parent
        if engine_core_output.num_cached_tokens > parent.num_cached_tokens:
            parent.num_cached_tokens = engine_core_output.num_cached_tokens
        if engine_core_output.kv_transfer_params is not None:
            parent.kv_transfer_params = engine_core_output.kv_transfer_params

        finished = finish_reason is not None
        if not finished and parent.output_kind == "final":
            return None
        delta = parent.output_kind == "delta"
        text = detokenizer.get_next_output_text(finished, delta)
        if delta:
            token_ids = list(new_token_ids[:num_new_tokens])
            logprobs = new_logprobs
        else:
            token_ids = detokenizer.output_token_ids
            logprobs = None if state.logprobs is None else list(state.logprobs)
        return CompletionOutput(
            index=state.index,
            text=text,
            token_ids=token_ids,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            logprobs=logprobs,
            error=error,
        )

    def _pooling_output(self, engine_core_output: EngineCoreOutput) -> PoolingRequestOutput:
        """A pooling request's one output: it finishes with its vector (the engine core sends nothing before)."""
        request_id, pooled = engine_core_output.request_id, engine_core_output.pooling_output
        if pooled is None:
            raise RuntimeError(f"pooling request {request_id} finished ({engine_core_output.finish_reason}, "
                               f"{engine_core_output.stop_reason}) without its pooled output")
        return PoolingRequestOutput(request_id, PoolingOutput(pooled), self.pooling_requests.pop(request_id),
                                    num_cached_tokens=engine_core_output.num_cached_tokens)

    def _finish_child(self, state: RequestState) -> None:
        parent = state.parent
        parent.unfinished_child_ids.discard(state.request_id)
        if parent.finished:
            self.parent_requests.pop(parent.request_id, None)


def _logprobs_dicts(logprobs: LogprobsLists | None, num_tokens: int | None = None) -> list[dict[int, float]]:
    """One {token id: logprob} per position, the sampled token first, for the first num_tokens positions (all when
    None)."""
    if logprobs is None:
        return []
    rows = zip(logprobs.token_ids[:num_tokens], logprobs.logprobs[:num_tokens], strict=True)
    return [dict(zip(token_ids, values, strict=True)) for token_ids, values in rows]
