"""StructuredOutputManager (vLLM v1's): the engine's grammars. Compiles each request's constraint off the step loop
(a thread pool, one compile per constraint text), gives each request its own matcher, fills the step's packed token
bitmask while the forward runs, and advances a matcher by each token its request samples (a token it forbids ends
the request as an error).

A matcher only ever advances by tokens appended to its request, so it is never ahead of them: tokens of a step
discarded by preemption were never accepted, and a resumed request keeps its tokens and its matcher alike. Draft
tokens (speculative decoding) move it only tentatively, rolled back before the call returns: to cut a proposal at
the first draft its grammar rejects (validate_tokens), and to fill one bitmask row per position a step verifies."""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from raylm.cluster.core.reasoning import ReasoningParser, get_reasoning_parser
from raylm.cluster.core.request import Request, RequestStatus
from raylm.cluster.core.structured_output.backend_types import CompiledGrammar, StructuredOutputBackend
from raylm.cluster.core.structured_output.request import StructuredOutputRequest
from raylm.cluster.core.structured_output.validation import validate_structured_outputs
from raylm.common.outputs import DRAFT_PLACEHOLDER, GrammarOutput, SchedulerOutput
from raylm.common.structured_outputs import StructuredOutputsParams
from raylm.configs import EngineConfig
from raylm.configs.gguf_metadata import get_tokenizer

logger = logging.getLogger(__name__)
_CACHE_SIZE = 1024  # compiled constraints kept (an LRU over their texts)
_WORD_BITS = 32


class StructuredOutputManager:
    def __init__(self, engine_config: EngineConfig, num_compile_threads: int = 2) -> None:
        self.config = engine_config.structured_outputs_config
        self.model_info = model_info = engine_config.model_info
        self.tokenizer_name = engine_config.model_config.tokenizer
        self.backends = engine_config.resolved.structured_outputs_backends
        # A request with k drafts samples k + 1 positions, each with its own row.
        max_rows = engine_config.scheduler_config.max_num_seqs * engine_config.resolved.uniform_decode_query_len
        self.executor = ThreadPoolExecutor(num_compile_threads, thread_name_prefix="raylm-grammar")
        self._compiled: OrderedDict[tuple[Any, ...], Future[CompiledGrammar]] = OrderedDict()
        self._backends: dict[str, StructuredOutputBackend] = {}
        self._init_lock = threading.Lock()  # backends and the tokenizer are built by the first compile that needs them
        self._tokenizer: Any = None
        self.reasoner: ReasoningParser | None = None
        self.bitmask = torch.zeros(max_rows, -(-model_info.vocab_size // _WORD_BITS), dtype=torch.int32)
        self._scratch = torch.zeros(1, self.bitmask.shape[1], dtype=torch.int32)

    # ---- requests in ----------------------------------------------------------------------------

    def grammar_init(self, request: Request) -> None:
        """Start compiling the request's constraint (or reuse the compile of the same text)."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        backend = validate_structured_outputs(params, self.backends)
        key = (backend, params.kind, params.spec, params.disable_any_whitespace, params.whitespace_pattern)
        future = self._compiled.get(key)
        if future is None:
            future = self._compiled[key] = self.executor.submit(self._compile, backend, params)
            if len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        reasoning_ended_in_prompt = None
        if self.config.reasoning_parser is not None:
            # The reasoner is built by the first compile, from the same tokenizer, so it exists once this is asked.
            def reasoning_ended_in_prompt() -> bool:
                assert self.reasoner is not None
                return self.reasoner.is_reasoning_end(request.prompt_token_ids)
        request.structured_output_request = StructuredOutputRequest(params, future, reasoning_ended_in_prompt)

    def _compile(self, backend_name: str, params: StructuredOutputsParams) -> CompiledGrammar:
        return self._backend(backend_name).compile(params)

    def _backend(self, name: str) -> StructuredOutputBackend:
        with self._init_lock:
            backend = self._backends.get(name)
            if backend is not None:
                return backend
            if self._tokenizer is None:
                # The engine's own loader (LLMEngine's), so that the grammar and the detokenizer see one vocabulary on
                # every model path: a folder, a GGUF file, a `tokenizer` override, a hub id.
                assert self.tokenizer_name is not None, "resolution sets the tokenizer (the model's by default)"
                self._tokenizer = get_tokenizer(self.tokenizer_name)
                self.reasoner = get_reasoning_parser(self.config.reasoning_parser, self._tokenizer)
            vocab_size = self.model_info.vocab_size
            if name == "xgrammar":
                from raylm.cluster.core.structured_output.backend_xgrammar import XgrammarBackend

                backend = XgrammarBackend(self._tokenizer, vocab_size, self._stop_token_ids())
            else:
                from raylm.cluster.core.structured_output.backend_guidance import GuidanceBackend

                backend = GuidanceBackend(self._tokenizer, vocab_size)
            self._backends[name] = backend
            return backend

    def _stop_token_ids(self) -> list[int]:
        stops = set(self.model_info.eos_token_ids)
        if self._tokenizer.eos_token_id is not None:
            stops.add(self._tokenizer.eos_token_id)
        return sorted(stops)

    # ---- one step -----------------------------------------------------------------------------

    def sampling_requests(self, scheduler_output: SchedulerOutput, requests: dict[str, Request]) -> list[str]:
        """The constrained requests of a step that sample in it (a partial prefill does not), in schedule order. Asked
        right after schedule(): a sampling step has computed every known token, and under async scheduling every
        pending one but its own (the placeholder it just added)."""
        ids = []
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(req_id)
            if request is None or request.structured_output_request is None:
                continue
            own_placeholder = 1 if request.num_output_placeholders else 0
            if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders - own_placeholder:
                ids.append(req_id)
        return ids

    def grammar_bitmask(self, requests: dict[str, Request], req_ids: list[str],
                        spec_tokens: dict[str, list[int]]) -> GrammarOutput | None:
        """The bitmask of the requests (from sampling_requests) whose grammar applies now: their matchers must have
        accepted every token before this step's (the engine waits for the step before when it has not). A request
        with drafts (`spec_tokens`, the step's scheduled_spec_decode_tokens) gets 1 + len(drafts) consecutive rows,
        one per position it samples, in the order of its logits rows."""
        rows: list[str] = []
        num_rows = 0
        for req_id in req_ids:
            request = requests.get(req_id)
            if request is None or request.is_finished:
                continue  # finished by the step before; its sample is discarded
            drafts = spec_tokens.get(req_id, [])
            # Under async scheduling a constrained request gets no drafts (DraftScheduling.draft_tokens): the runner
            # would fill placeholders with proposals this manager never sees.
            assert DRAFT_PLACEHOLDER not in drafts, req_id
            if self._fill_rows(request, drafts, num_rows):
                rows.append(req_id)
                num_rows += 1 + len(drafts)
        if not rows:
            return None
        return GrammarOutput(rows, self.bitmask[:num_rows].numpy().copy())

    def _fill_rows(self, request: Request, drafts: list[int], start: int) -> bool:
        """Rows start .. start + len(drafts) of the bitmask (vLLM's shape): each filled at the matcher's state, which
        then advances by that position's draft; the matcher is rolled back after the last row. False (rows left
        as they are) where the grammar applies at none of the positions. A row where it does not apply (reasoning
        still open, or the grammar ended by an earlier draft) allows every token: the request stops before it."""
        structured = request.structured_output_request
        assert structured is not None and structured.grammar is not None
        grammar, bitmask = structured.grammar, self.bitmask
        ended, applies, advanced = structured.reasoning_ended, False, 0
        for i in range(len(drafts) + 1):
            if ended and not grammar.is_terminated():
                grammar.fill_bitmask(bitmask, start + i)
                applies = True
            else:
                bitmask[start + i] = -1  # every bit set
            if i == len(drafts):
                break
            if not ended:
                ended = self._reasoning_ends(request, drafts[: i + 1])
            elif not grammar.is_terminated():
                # The scheduler verifies only drafts validate_tokens let through, at this same matcher state.
                accepted = grammar.accept_tokens(request.request_id, [drafts[i]])
                assert accepted, (request.request_id, drafts)
                advanced += 1
        grammar.rollback(advanced)
        return applies

    def validate_tokens(self, request: Request, tokens: list[int]) -> list[int]:
        """The longest prefix of a proposal (draft tokens after the request's tokens) that its grammar allows (vLLM's
        name): a draft it rejects would only be rejected by the bitmask, and the drafts after it with it, so the
        engine does not verify them. Drafts before the reasoning ends are not the grammar's."""
        structured = request.structured_output_request
        if structured is None or structured.grammar is None or not tokens:
            return tokens
        start = 0  # the first draft that is the grammar's
        if not structured.reasoning_ended:
            start = next((i + 1 for i in range(len(tokens)) if self._reasoning_ends(request, tokens[: i + 1])),
                         len(tokens))
        return tokens[:start] + structured.grammar.validate_tokens(tokens[start:])

    def _reasoning_ends(self, request: Request, drafts: list[int]) -> bool:
        """Whether the request's reasoning is closed once these drafts follow its tokens (as advance() decides it
        for accepted tokens: the closing token itself is not the grammar's)."""
        assert self.reasoner is not None
        return self.reasoner.is_reasoning_end([*request.output_token_ids, *drafts])

    def accept(self, request: Request, token_id: int) -> bool:
        """Feed a sampled token to the request's matcher before it joins the request (vLLM's accept_tokens). False
        when the grammar forbids it, which its bitmask should have made impossible: the request then ends as an
        error naming the token and the constraint, and the token is dropped, so that no unchecked text goes out."""
        structured = request.structured_output_request
        if structured is None or structured.grammar is None or not structured.reasoning_ended:
            return True  # a reasoning token is not the grammar's
        if structured.grammar.accept_tokens(request.request_id, [token_id]):
            return True
        params = structured.params
        spec = params.spec if len(params.spec) <= 200 else params.spec[:200] + "..."
        request.status = RequestStatus.FINISHED_ERROR
        request.stop_reason = (f"{params.kind}: the sampled token {token_id} ({self._tokenizer.decode([token_id])!r}) "
                               f"is not allowed by the request's grammar ({params._backend}: {spec!r}) after "
                               f"{request.num_output_tokens} output tokens")
        logger.warning("request %s: %s", request.request_id, request.stop_reason)
        return False

    def advance(self, request: Request, token_id: int) -> bool:
        """After `accept`, once the token joined the request: True when the grammar ends the request (finish reason
        stop): it terminated, or only a stop token may follow while min_tokens forbids one."""
        structured = request.structured_output_request
        if structured is None or structured.grammar is None:
            return False
        if not structured.reasoning_ended:
            assert self.reasoner is not None
            structured.reasoning_ended = self.reasoner.is_reasoning_end(request.output_token_ids)
            return False
        grammar = structured.grammar
        ended = grammar.is_terminated() or (
            request.num_output_tokens < request.sampling_params.min_tokens and self._only_stop_allowed(grammar))
        if ended:
            request.status = RequestStatus.FINISHED_STOPPED
        return ended

    def ends_before_start(self, request: Request) -> bool:
        """A grammar that allows only a stop token from the start while min_tokens forbids one: the request ends
        (stop) with no output, rather than sampling from a row that allows nothing."""
        structured = request.structured_output_request
        return (structured is not None and structured.grammar is not None and structured.reasoning_ended
                and request.num_output_tokens < request.sampling_params.min_tokens
                and self._only_stop_allowed(structured.grammar))

    def _only_stop_allowed(self, grammar: Any) -> bool:
        scratch = self._scratch
        grammar.fill_bitmask(scratch, 0)
        for token_id in self._stop_token_ids():
            word, bit = divmod(token_id, _WORD_BITS)
            scratch[0, word] &= ~(1 << bit)
        return not bool(scratch.any())

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
