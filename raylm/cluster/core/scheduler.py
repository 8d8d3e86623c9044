"""The unified scheduler (vLLM v1 style): no prefill and decode phases. Each request has
`num_computed_tokens` that catches up to its `num_tokens`; a step hands out a token budget,
running requests first, then waiting ones, preempting when the KV pool runs dry.

Protocol with the engine: call `schedule()`, run the step, then `update_from_output()` with that
step's output; with several steps in flight, updates come back in schedule order. Request ids
must be unique over the engine's lifetime (outputs of removed requests are recognised by id).

Over 300 lines because schedule() and update_from_output() are one concept sharing the queues and the KV state (vLLM's
is one file of ~1,500); what they use has a file of its own (step_budget, request_queue, kv_cache_manager,
stop_checker, spec_decode, lora_scheduling, kv_transfer_tracker).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from raylm.cluster.core.engine_core_output import EngineCoreOutput
from raylm.cluster.core.kv_cache_manager import KVCacheManager
from raylm.cluster.core.kv_transfer_tracker import KVTransferTracker
from raylm.cluster.core.lora_scheduling import LoRABatchLimit
from raylm.cluster.core.request import Request, RequestStatus
from raylm.cluster.core.request_queue import RequestQueue, create_request_queue, preemption_victim
from raylm.cluster.core.sliding_window_group import SlidingWindowGroup
from raylm.cluster.core.spec_decode import DraftScheduling
from raylm.cluster.core.step_budget import StepBudget, is_prefill
from raylm.cluster.core.stop_checker import check_stop
from raylm.cluster.core.structured_output.wait_list import GrammarWaitList
from raylm.common.outputs import CachedRequestData, LogprobsLists, ModelRunnerOutput, NewRequestData, SchedulerOutput
from raylm.configs.engine_config import CacheConfig, SchedulerConfig, SpeculativeConfig
from raylm.runner.kv_transfer import KVConnectorBase

if TYPE_CHECKING:
    import torch

    from raylm.cluster.core.block_pool import KVCacheBlock
    from raylm.cluster.core.structured_output import StructuredOutputManager
    from raylm.configs.kv_cache_groups import KVCacheGroups


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        max_model_len: int,
        num_blocks: int,
        block_size: int,
        send_token_ids: bool = False,
        speculative_config: SpeculativeConfig | None = None,
        kv_connector: KVConnectorBase | None = None,
        max_loras: int | None = None,
        structured_output_manager: StructuredOutputManager | None = None,
        sliding_window: int | None = None,
        kv_cache_groups: KVCacheGroups | None = None,
    ) -> None:
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        # Caps on prompt tokens per step (see step_budget.py); None: not resolved for a device (configs/
        # scheduler_defaults.py), so no cap.
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold
        self.max_prefill_tokens_with_decodes = scheduler_config.max_prefill_tokens_with_decodes or 0
        # Async scheduling plans step N+1 before step N's samples are back: the scheduled positions
        # whose token is still unknown are counted in `Request.num_output_placeholders`.
        self.async_scheduling = scheduler_config.async_scheduling
        self.policy = scheduler_config.scheduling_policy
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            # A resumed request recomputes prompt + outputs in one step; it must always fit.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({max_model_len}) when enable_chunked_prefill is False")
        self.max_model_len = max_model_len
        self.send_token_ids = send_token_ids  # PP > 1: stage 0 did not see the sampled tokens
        self.drafts = (None if speculative_config is None else
                       DraftScheduling(speculative_config, self.async_scheduling, max_model_len))
        self.max_loras = max_loras  # distinct adapters per step (LoRA's device slots); None: LoRA is off

        # Blocks out of every layer's window go back to the pool (kv_cache_manager.py); not under a KV connector,
        # which sends or saves a request's blocks by position.
        # A model mixing sliding and global layers splits the pool in two groups (configs/kv_cache_groups.py).
        caching = cache_config.enable_prefix_caching
        sliding_group = None if kv_cache_groups is None else SlidingWindowGroup(
            kv_cache_groups.num_sliding_blocks, block_size, kv_cache_groups.sliding_window, caching)
        self.kv_cache_manager = KVCacheManager(
            num_blocks if kv_cache_groups is None else kv_cache_groups.num_blocks, block_size, caching,
            sliding_window if kv_connector is None else None, sliding_group)
        # The scheduler side of a KV connector: external KV for requests, held blocks (see kv_transfer_tracker.py).
        self.kv_transfers = None if kv_connector is None else KVTransferTracker(kv_connector, self.kv_cache_manager)
        if kv_connector is not None:
            self.kv_cache_manager.block_pool.on_evict = kv_connector.on_block_evicted
        self.requests: dict[str, Request] = {}  # every unfinished request, waiting or running
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # finished, aborted or preempted since the last schedule
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # of requests that got their first token: vLLM's stats line and vllm:prompt_tokens
        self.structured_output_manager = structured_output_manager
        self.waiting_for_fsm = GrammarWaitList()  # requests whose grammar is compiling
        self.grammar_failures: list[EngineCoreOutput] = []  # reported with the next update_from_output

    # ---- requests in and out ---------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        prompt_len = request.num_prompt_tokens
        if prompt_len == 0:
            raise ValueError("the prompt is empty: at least one prompt token is needed")
        if request.pooling_params is not None:  # nothing is generated: the whole context is the prompt's
            if prompt_len > self.max_model_len:
                raise ValueError(f"the input has {prompt_len} tokens but max_model_len is {self.max_model_len}: "
                                 f"an input to pool must have at most max_model_len tokens")
        elif prompt_len >= self.max_model_len:
            raise ValueError(
                f"the prompt has {prompt_len} tokens but max_model_len is {self.max_model_len}: the prompt "
                f"must be shorter than max_model_len to leave room for at least one generated token")
        assert request.status == RequestStatus.WAITING and request.num_computed_tokens == 0
        room = self.max_model_len - prompt_len
        max_tokens = request.sampling_params.max_tokens
        request.max_tokens = 1 if request.pooling_params is not None else (
            room if max_tokens is None else min(max_tokens, room))
        self.kv_cache_manager.check_fits(request)
        self.requests[request.request_id] = request
        if not self.waiting_for_fsm.add(request):
            self.waiting.add(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish (typically abort) requests wherever they are; unknown or finished ids are ignored."""
        assert status.is_finished
        request_ids = (request_ids,) if isinstance(request_ids, str) else request_ids
        any_running = False
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                any_running = True
            elif not ((self.kv_transfers is not None and self.kv_transfers.discard(request))
                      or self.waiting_for_fsm.remove(request)):
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)
        if any_running:
            self.running = [request for request in self.running if not request.is_finished]

    def has_unfinished_requests(self) -> bool:
        """Requests, or KV transfers that need more steps to finish."""
        return bool(self.requests) or (self.kv_transfers is not None and self.kv_transfers.has_pending())

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- one step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self._admit_compiled_grammars()
        budget = StepBudget(self.max_num_batched_tokens, self.long_prefill_token_threshold,
                            self.max_prefill_tokens_with_decodes, self.running)
        num_scheduled_tokens: dict[str, int] = {}
        prefills: set[str] = set()  # requests scheduled for prompt tokens this step
        new_block_ids: dict[str, list[int]] = {}
        spec_tokens: dict[str, list[int]] = {}
        scheduled_running: list[Request] = []
        scheduled_new: list[Request] = []
        any_preempted = False
        loras = LoRABatchLimit(self.max_loras)

        running, allocate_slots = self.running, self.kv_cache_manager.allocate_slots
        req_index = 0
        while req_index < len(running) and budget.tokens > 0:
            request = running[req_index]
            num_new_tokens, prefill = self._num_tokens_to_schedule(request, budget)
            if num_new_tokens == 0 or not loras.admits(request):
                req_index += 1
                continue
            drafts, lookahead = (([], 0) if self.drafts is None else
                                 self.drafts.plan(request, num_new_tokens, budget.tokens))
            num_new_tokens += len(drafts)
            while (block_ids := allocate_slots(request, num_new_tokens, num_lookahead_tokens=lookahead)) is None:
                victim_index = preemption_victim(running, self.policy)
                victim = running.pop(victim_index)
                if victim_index < req_index:
                    req_index -= 1
                if victim.request_id in num_scheduled_tokens:  # already scheduled this step: undo that
                    budget.give_back(num_scheduled_tokens.pop(victim.request_id), victim.request_id in prefills)
                    del new_block_ids[victim.request_id]
                    spec_tokens.pop(victim.request_id, None)
                    scheduled_running.remove(victim)
                self._preempt(victim)
                any_preempted = True
                if victim is request:
                    break
            if block_ids is None:
                continue  # the request preempted itself; req_index already points at the next one
            num_scheduled_tokens[request.request_id] = num_new_tokens
            new_block_ids[request.request_id] = block_ids
            if drafts:
                spec_tokens[request.request_id] = drafts
            scheduled_running.append(request)
            loras.add(request)
            budget.take(num_new_tokens, prefill)
            if prefill:
                prefills.add(request.request_id)
            req_index += 1

        # Admitting while preempting would only thrash the pool.
        skipped: list[tuple[RequestQueue, Request]] = []  # requests whose adapter finds no free slot this step
        while not any_preempted and budget.tokens > 0 and len(self.running) < self.max_num_seqs:
            queue = self.waiting if self.kv_transfers is None else self.kv_transfers.admission_queue(self.waiting)
            if not queue:
                break
            request = queue.peek()
            if not loras.admits(request):
                skipped.append((queue, queue.pop()))
                continue
            computed_blocks: list[KVCacheBlock]
            if request.request_id in self.kv_cache_manager.req_to_blocks:  # its external KV arrived into them
                computed_blocks, num_computed_tokens = [], request.num_computed_tokens
            elif request.pooling_params is not None and request.pooling_params.skip_reading_prefix_cache:
                computed_blocks, num_computed_tokens = [], 0  # it pools every prompt token's hidden state
            else:
                computed_blocks, num_computed_tokens = self.kv_cache_manager.get_computed_blocks(request)
                if self.kv_transfers is not None and (receiving := self.kv_transfers.try_receive(
                        request, computed_blocks, num_computed_tokens)) is not False:
                    if receiving is None:
                        break  # no room for the blocks its KV goes into
                    queue.pop()  # it waits for its KV outside the queue: the requests behind it go on
                    continue
            wanted = request.num_tokens - num_computed_tokens
            prefill = wanted > 1
            num_new_tokens = budget.grant(wanted, prefill)
            if num_new_tokens == 0 or (num_new_tokens < wanted and not self.enable_chunked_prefill):
                break  # waits for a step with room, keeping the queue order
            lookahead = self.drafts.lookahead(request, num_computed_tokens + num_new_tokens) if self.drafts else 0
            # An arrived request's computed tokens are in blocks it holds already: no prefix hits to take.
            num_hit_tokens = len(computed_blocks) * self.kv_cache_manager.block_size
            if self.kv_cache_manager.allocate_slots(
                    request, num_new_tokens, num_hit_tokens, computed_blocks, lookahead) is None:
                break
            queue.pop()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed_tokens
            self.running.append(request)
            scheduled_new.append(request)
            if self.kv_transfers is not None:
                self.kv_transfers.after_alloc(request)
            loras.add(request)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            budget.take(num_new_tokens, prefill)
        for queue, request in reversed(skipped):  # back in front of the queue they left, in their order
            queue.add_preempted(request)

        output = SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData(req.request_id, list(req.prompt_token_ids), list(req.output_token_ids),
                               req.sampling_params, self.kv_cache_manager.get_block_ids(req.request_id),
                               req.num_computed_tokens, req.lora_request, req.pooling_params,
                               self.kv_cache_manager.get_sliding_block_ids(req.request_id))
                for req in scheduled_new],
            scheduled_cached_reqs=self._cached_request_data(scheduled_running, new_block_ids),
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget.tokens,
            finished_req_ids=self.finished_req_ids,
            scheduled_spec_decode_tokens=spec_tokens,
        )
        self.finished_req_ids = set()
        if self.kv_transfers is not None:
            output.kv_connector_metadata = self.kv_transfers.connector.build_connector_meta(output)
        for request in scheduled_running + scheduled_new:
            req_id = request.request_id
            self._advance(request, num_scheduled_tokens[req_id], len(spec_tokens.get(req_id, ())))
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append the sampled tokens, finish requests that stop, and report one delta per request
        that got tokens or finished. Requests finished, aborted or preempted since that step was
        scheduled are skipped."""
        row_of = {req_id: i for i, req_id in enumerate(model_runner_output.req_ids)}
        sampled_token_ids = model_runner_output.sampled_token_ids
        outputs, self.grammar_failures = self.grammar_failures, []
        finished_requests: set[Request] = set()
        grammar = self.structured_output_manager
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None:
                continue
            request.num_inflight_steps -= 1
            if request.num_stale_steps > 0:
                request.num_stale_steps -= 1
                continue
            if request.pooling_params is not None:
                pooled = model_runner_output.pooler_output.get(req_id)
                if pooled is not None:  # else a partial prefill
                    outputs.append(self._finish_pooling(request, pooled))
                    finished_requests.add(request)
                continue
            row = row_of.get(req_id)
            sampled = sampled_token_ids[row] if row is not None else None
            if not sampled:
                continue  # a partial prefill
            assert row is not None  # a request with sampled tokens has a row
            num_drafts = len(scheduler_output.scheduled_spec_decode_tokens.get(req_id, ()))
            if num_drafts:
                assert self.drafts is not None
                self.drafts.verified(request, num_drafts, len(sampled))
            if request.num_output_placeholders:
                request.num_output_placeholders -= 1 + num_drafts  # what _advance counted for the step
                assert request.num_output_placeholders >= 0
            if request.num_output_tokens == 0:
                self.num_prompt_tokens += request.num_prompt_tokens
            num_new_tokens, finished = 0, False  # a request in self.requests is unfinished until check_stop says
            for token_id in sampled:
                if grammar is not None and not grammar.accept(request, token_id):
                    finished = True  # an error: the grammar forbids the token, which is dropped
                    break
                request.append_output_token_id(token_id)
                num_new_tokens += 1
                if check_stop(request) or (grammar is not None and grammar.advance(request, token_id)):
                    finished = True
                    break
            logprobs = model_runner_output.logprobs.get(req_id)
            if logprobs is not None and num_new_tokens < len(sampled):
                logprobs = _slice_logprobs(logprobs, num_new_tokens)
            kv_transfer_params = None
            if finished:
                finished_requests.add(request)
                kv_transfer_params = self._free_request(request)
            elif model_runner_output.spec_token_ids:
                drafts = model_runner_output.spec_token_ids[row]
                request.spec_token_ids = drafts if grammar is None else grammar.validate_tokens(request, drafts)
            outputs.append(EngineCoreOutput(
                req_id, sampled[:num_new_tokens], request.get_finished_reason() if finished else None,
                request.stop_reason, logprobs, max(request.num_cached_tokens, 0),
                model_runner_output.prompt_logprobs.get(req_id), kv_transfer_params))
        if finished_requests:
            self.running = [request for request in self.running if request not in finished_requests]
        if self.kv_transfers is not None and model_runner_output.kv_connector_output is not None:
            self.kv_transfers.update(model_runner_output.kv_connector_output)
        return outputs

    # ---- metrics and cache control ----------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.waiting_for_fsm)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_cache_manager.usage

    @property
    def prefix_cache_queries(self) -> int:
        return self.kv_cache_manager.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.kv_cache_manager.prefix_cache_hits

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    # ---- internals -----------------------------------------------------------------------------

    def _num_tokens_to_schedule(self, request: Request, budget: StepBudget) -> tuple[int, bool]:
        """Tokens `request` computes this step, and whether they are prompt tokens."""
        num_tokens, num_placeholders = request.num_tokens, request.num_output_placeholders
        if num_tokens - request.num_prompt_tokens + num_placeholders >= request.max_tokens:
            return 0, False  # async: the samples in flight already reach max_tokens
        # Without chunked prefill a running request only ever has decode tokens left (a whole prompt
        # was admitted at once), so capping by the budget never splits a prompt.
        prefill = is_prefill(request)
        return budget.grant(num_tokens + num_placeholders - request.num_computed_tokens, prefill), prefill

    def _admit_compiled_grammars(self) -> None:
        """Queue the requests whose grammar compiled; finish (error) those whose grammar failed to."""
        if not self.running and not self.waiting and self.waiting_for_fsm:
            self.waiting_for_fsm.wait(timeout=0.05)  # rather than spin through empty steps
        ready, ended = self.waiting_for_fsm.pop_ready(self.structured_output_manager)
        for request in ready:
            self.waiting.add(request)
        for request in ended:
            self._free_request(request)
            self.grammar_failures.append(EngineCoreOutput(request.request_id, [], request.get_finished_reason(),
                                                          request.stop_reason))

    def _preempt(self, request: Request) -> None:
        """Free the blocks and requeue; the tokens so far are kept and recomputed on resumption."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0
        request.spec_token_ids = []
        request.num_stale_steps = request.num_inflight_steps
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_preempted(request)
        self.finished_req_ids.add(request.request_id)

    def _advance(self, request: Request, num_tokens: int, num_drafts: int) -> None:
        """Count the scheduled tokens (drafts included) as computed right away so the next step can be planned
        before this one's output is back."""
        request.num_computed_tokens = num_computed = request.num_computed_tokens + num_tokens
        request.num_inflight_steps += 1
        request.num_sent_tokens = num_known = request.num_tokens
        num_known_or_pending = num_known + request.num_output_placeholders
        pooling = request.pooling_params is not None  # never samples
        if self.async_scheduling and not pooling and num_computed == num_known_or_pending + num_drafts:
            # This step samples; its tokens are not known yet (planned as if every draft is accepted).
            request.num_output_placeholders += 1 + num_drafts
            num_known_or_pending += 1 + num_drafts
        assert num_computed - num_drafts <= num_known_or_pending
        assert num_computed < self.max_model_len or (pooling and num_computed == self.max_model_len)

    def _finish_pooling(self, request: Request, pooled: torch.Tensor) -> EngineCoreOutput:
        """A pooling request's prompt is computed: it leaves with its vector, having sampled nothing."""
        self.num_prompt_tokens += request.num_prompt_tokens
        request.status = RequestStatus.FINISHED_STOPPED
        kv_transfer_params = self._free_request(request)
        return EngineCoreOutput(request.request_id, [], request.get_finished_reason(), None,
                                num_cached_tokens=max(request.num_cached_tokens, 0),
                                kv_transfer_params=kv_transfer_params, pooling_output=pooled)

    def _cached_request_data(self, requests: list[Request], new_block_ids: dict[str, list[int]]) -> CachedRequestData:
        req_ids = [request.request_id for request in requests]
        new_sliding_block_ids: list[list[int]] = []
        if self.kv_cache_manager.sliding_group is not None:  # as many new positions as the global layers' ids
            for req_id in req_ids:
                sliding_ids = self.kv_cache_manager.get_sliding_block_ids(req_id)
                new_sliding_block_ids.append(sliding_ids[len(sliding_ids) - len(new_block_ids[req_id]):])
        return CachedRequestData(
            req_ids, [new_block_ids[req_id] for req_id in req_ids], [req.num_computed_tokens for req in requests],
            [req.all_token_ids[req.num_sent_tokens:] if self.send_token_ids else [] for req in requests],
            new_sliding_block_ids)

    def _free_request(self, request: Request) -> dict[str, Any] | None:
        """A finished request leaves the engine core: blocks back to the pool (unless a KV connector still sends
        from them), the runner told. Returns the connector's kv_transfer_params for the caller."""
        assert request.is_finished
        delay_free, kv_transfer_params = (False, None) if self.kv_transfers is None else (
            self.kv_transfers.request_finished(request))
        if not delay_free:
            self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)
        return kv_transfer_params


def _slice_logprobs(logprobs: LogprobsLists, num_positions: int) -> LogprobsLists:
    return LogprobsLists(logprobs.token_ids[:num_positions], logprobs.logprobs[:num_positions],
                         logprobs.ranks[:num_positions])
