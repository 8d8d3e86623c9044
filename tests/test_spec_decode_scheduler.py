"""The scheduler's side of speculative decoding on hand-made cases, with a fake runner that verifies drafts against a
known "true" token per position: drafts scheduled and counted in the budget, KV slots (and a draft model's lookahead)
allocated, num_computed_tokens moved back by the rejected drafts, placeholders under async scheduling, preemption,
only accepted tokens in prefix-cache blocks, every block back in the pool at the end, and vLLM's counters."""
from __future__ import annotations

from dataclasses import dataclass

from raylm.cluster.core.block_pool import hash_block_tokens
from raylm.cluster.core.request import Request
from raylm.cluster.core.scheduler import Scheduler
from raylm.cluster.core.spec_decode import SpecDecodingStats
from raylm.common.outputs import DRAFT_PLACEHOLDER, ModelRunnerOutput, SchedulerOutput
from raylm.common.sampling_params import SamplingParams
from raylm.configs.engine_config import CacheConfig, SchedulerConfig, SpeculativeConfig

BLOCK_SIZE = 4
WRONG = 3  # a draft token no position's true token equals


def true_token(position: int) -> int:
    return 1000 + position


@dataclass
class _State:
    token_ids: list[int]
    block_ids: list[int]
    num_computed: int


class SpecFakeRunner:
    """Keeps a runner's state from the SchedulerOutput diffs, verifies the drafts (accepted while equal to the true
    token), and proposes k drafts of which the first `num_good(step)` are right."""

    def __init__(self, k: int, num_good: list[int]) -> None:
        self.k, self.num_good = k, num_good
        self.requests: dict[str, _State] = {}
        self.proposals: dict[str, list[int]] = {}
        self.steps = 0
        self.outputs: list[SchedulerOutput] = []

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.outputs.append(out)
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.requests[new.req_id] = _State(new.prompt_token_ids + new.output_token_ids, list(new.block_ids),
                                               new.num_computed_tokens)
        cached = out.scheduled_cached_reqs
        for req_id, block_ids, num_computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            state = self.requests[req_id]
            assert num_computed >= state.num_computed  # async: the scheduler counted in-flight drafts as accepted
            state.block_ids += block_ids
        req_ids, sampled, proposals = [], [], []
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            state = self.requests[req_id]
            drafts = out.scheduled_spec_decode_tokens.get(req_id, [])
            if drafts and drafts[0] == DRAFT_PLACEHOLDER:
                own = self.proposals.get(req_id, [])[: len(drafts)]
                drafts = own + [WRONG] * (len(drafts) - len(own))
            assert num_tokens >= 1 + len(drafts) or not drafts
            end = state.num_computed + num_tokens
            assert len(state.block_ids) * BLOCK_SIZE >= end, "every scheduled token has a KV slot"
            req_ids.append(req_id)
            if end - len(drafts) < len(state.token_ids):  # a partial prefill
                state.num_computed = end
                sampled.append([])
                proposals.append([])
                continue
            position = len(state.token_ids)
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == true_token(position + accepted):
                accepted += 1
            tokens = [true_token(position + i) for i in range(accepted + 1)]
            state.token_ids += tokens
            state.num_computed = len(state.token_ids) - 1
            sampled.append(tokens)
            good = self.num_good[self.steps % len(self.num_good)]
            nxt = len(state.token_ids)
            self.proposals[req_id] = [true_token(nxt + i) if i < good else WRONG for i in range(self.k)]
            proposals.append(self.proposals[req_id])
        self.steps += 1
        return ModelRunnerOutput(req_ids, sampled, spec_token_ids=proposals)


def make_scheduler(k: int = 3, method: str = "ngram", num_blocks: int = 64, max_model_len: int = 64,
                   max_num_batched_tokens: int = 64, async_scheduling: bool = False) -> Scheduler:
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k,
                             model="draft" if method == "draft_model" else None)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, async_scheduling=async_scheduling),
                     CacheConfig(block_size=BLOCK_SIZE), max_model_len, num_blocks, BLOCK_SIZE,
                     speculative_config=spec)


def make_request(req_id: str, prompt_len: int, max_tokens: int) -> Request:
    return Request(req_id, [true_token(i) for i in range(prompt_len)], SamplingParams(max_tokens=max_tokens), {2})


def step(scheduler: Scheduler, runner: SpecFakeRunner) -> SchedulerOutput:
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner.execute(out))
    return out


def run(scheduler: Scheduler, runner: SpecFakeRunner, depth: int = 1) -> None:
    in_flight: list[SchedulerOutput] = []
    for _ in range(500):
        if scheduler.has_unfinished_requests() and len(in_flight) < depth:
            in_flight.append(scheduler.schedule())
        elif in_flight:
            out = in_flight.pop(0)
            scheduler.update_from_output(out, runner.execute(out))
        else:
            break
    assert not scheduler.has_unfinished_requests()


def assert_pool_empty(scheduler: Scheduler) -> None:
    manager = scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks and manager.req_to_blocks == {}
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)


def test_accounting_step_by_step() -> None:
    scheduler, runner = make_scheduler(k=3), SpecFakeRunner(k=3, num_good=[1])
    request = make_request("a", 5, max_tokens=20)
    scheduler.add_request(request)
    out = step(scheduler, runner)  # the prompt: no drafts yet; the runner proposes [right, wrong, wrong]
    assert out.num_scheduled_tokens == {"a": 5} and out.scheduled_spec_decode_tokens == {}
    assert request.num_tokens == 6 and request.num_computed_tokens == 5
    assert request.spec_token_ids == [true_token(6), WRONG, WRONG]

    out = scheduler.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [true_token(6), WRONG, WRONG]}
    assert out.num_scheduled_tokens == {"a": 4} and out.total_num_scheduled_tokens == 4  # 1 + 3 drafts
    assert request.num_computed_tokens == 9  # all counted when scheduled...
    assert scheduler.kv_cache_manager.get_block_ids("a") == [0, 1, 2]  # ...and all given slots: 9 tokens, 3 blocks
    scheduler.update_from_output(out, runner.execute(out))
    # One draft accepted, two rejected: 2 tokens came back and computed moves back by 2.
    assert request.output_token_ids == [true_token(5), true_token(6), true_token(7)]
    assert request.num_computed_tokens == 7 == request.num_tokens - 1
    stats = scheduler.drafts.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    assert stats.num_accepted_tokens_per_pos == [1, 0, 0]

    out = scheduler.schedule()  # the rejected drafts' slots are reused: no new block for positions 7..10
    assert out.scheduled_cached_reqs.new_block_ids == [[]] and request.num_computed_tokens == 11
    scheduler.update_from_output(out, runner.execute(out))
    run(scheduler, runner)
    assert request.output_token_ids == [true_token(5 + i) for i in range(20)]
    assert_pool_empty(scheduler)


def test_drafts_cut_by_budget_max_tokens_and_max_model_len() -> None:
    scheduler, runner = make_scheduler(k=5, max_num_batched_tokens=8), SpecFakeRunner(k=5, num_good=[5])
    for req_id in ("a", "b"):
        scheduler.add_request(make_request(req_id, 4, max_tokens=10))
    step(scheduler, runner)
    out = scheduler.schedule()  # 1 + 5 for a, then 2 tokens of budget left for b: 1 + 1
    assert out.scheduled_spec_decode_tokens == {"a": [true_token(5 + i) for i in range(5)], "b": [true_token(5)]}
    assert out.total_num_scheduled_tokens == 8
    scheduler.update_from_output(out, runner.execute(out))
    request = scheduler.requests["a"]
    assert request.num_output_tokens == 7  # every draft accepted, plus the bonus
    out = scheduler.schedule()
    # 3 outputs left for a: at most 2 drafts (a token always follows them); b gets the rest of the budget.
    assert len(out.scheduled_spec_decode_tokens["a"]) == 2
    scheduler.update_from_output(out, runner.execute(out))
    run(scheduler, runner)
    assert [true_token(4 + i) for i in range(10)] == request.output_token_ids
    assert_pool_empty(scheduler)

    scheduler, runner = make_scheduler(k=5, max_model_len=12), SpecFakeRunner(k=5, num_good=[5])
    request = make_request("c", 8, max_tokens=100)
    scheduler.add_request(request)  # max_tokens capped to 4 by max_model_len
    step(scheduler, runner)
    out = scheduler.schedule()
    assert len(out.scheduled_spec_decode_tokens["c"]) == 2 and request.num_computed_tokens == 11
    scheduler.update_from_output(out, runner.execute(out))
    assert request.is_finished and request.num_tokens == 12
    assert_pool_empty(scheduler)


def test_many_rejections_cache_only_accepted_tokens_and_free_every_block() -> None:
    scheduler = make_scheduler(k=4, num_blocks=40)
    runner = SpecFakeRunner(k=4, num_good=[0, 1, 0, 2, 4])
    requests = [make_request(f"r{i}", 3 + 2 * i, max_tokens=30) for i in range(4)]
    for request in requests:
        scheduler.add_request(request)
    run(scheduler, runner)
    stats = scheduler.drafts.stats
    assert stats.num_draft_tokens - stats.num_accepted_tokens > 50  # many rejections
    for request in requests:
        assert request.output_token_ids == [true_token(request.num_prompt_tokens + i) for i in range(30)]
    # Every cached block holds accepted tokens only: its hash is that of a true prefix.
    true_hashes, parent = set(), None
    for i in range(40 // BLOCK_SIZE + 10):
        parent = hash_block_tokens(parent, [true_token(p) for p in range(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE)])
        true_hashes.add(parent)
    cached = scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
    assert cached and set(cached) <= true_hashes
    assert_pool_empty(scheduler)


def test_preemption_drops_the_victims_drafts() -> None:
    scheduler, runner = make_scheduler(k=3, num_blocks=7), SpecFakeRunner(k=3, num_good=[3])
    requests = [make_request(req_id, 7, max_tokens=14) for req_id in ("a", "b")]
    for request in requests:
        scheduler.add_request(request)
    run(scheduler, runner)
    assert scheduler.num_preemptions > 0
    for out in runner.outputs:
        assert set(out.scheduled_spec_decode_tokens) <= set(out.num_scheduled_tokens)
        # A resumed request recomputes its tokens first: no drafts ride on that step.
        assert not {new.req_id for new in out.scheduled_new_reqs} & set(out.scheduled_spec_decode_tokens)
    for request in requests:
        assert request.output_token_ids == [true_token(7 + i) for i in range(14)]
    assert_pool_empty(scheduler)


def test_async_scheduling_plans_with_placeholders() -> None:
    scheduler, runner = make_scheduler(k=3, async_scheduling=True), SpecFakeRunner(k=3, num_good=[2, 0, 3])
    request = make_request("a", 6, max_tokens=25)
    scheduler.add_request(request)
    run(scheduler, runner, depth=2)
    assert request.output_token_ids == [true_token(6 + i) for i in range(25)]
    placeholders = [out.scheduled_spec_decode_tokens["a"] for out in runner.outputs
                    if "a" in out.scheduled_spec_decode_tokens]
    assert placeholders and all(set(drafts) == {DRAFT_PLACEHOLDER} for drafts in placeholders)
    assert request.num_output_placeholders == 0
    assert scheduler.drafts.stats.num_accepted_tokens > 0
    assert_pool_empty(scheduler)


def test_draft_model_gets_lookahead_slots() -> None:
    scheduler, runner = make_scheduler(k=3, method="draft_model"), SpecFakeRunner(k=3, num_good=[1, 0, 3])
    request = make_request("a", 5, max_tokens=40)
    scheduler.add_request(request)
    out = scheduler.schedule()
    # 5 prompt tokens and 3 slots for the drafts written after the first sample: 8 slots, 2 blocks.
    assert len(scheduler.kv_cache_manager.get_block_ids("a")) == 2
    for _ in range(8):
        scheduler.update_from_output(out, runner.execute(out))
        # The draft model wrote drafts 1..k-1 after the new last token: positions up to num_tokens + k - 2.
        assert len(scheduler.kv_cache_manager.get_block_ids("a")) * BLOCK_SIZE >= request.num_tokens + 3 - 1
        out = scheduler.schedule()
    scheduler = make_scheduler(k=3, method="draft_model", max_model_len=8)
    scheduler.add_request(make_request("b", 6, max_tokens=2))
    scheduler.schedule()  # no lookahead past the request's last possible token (position 6)
    assert len(scheduler.kv_cache_manager.get_block_ids("b")) == 2


def test_stats_intervals_and_totals() -> None:
    stats = SpecDecodingStats.new(3)
    stats.observe(3, 2)
    earlier = stats.copy()
    stats.observe(2, 0)
    stats.observe(3, 3)
    interval = stats.minus(earlier)
    assert (interval.num_drafts, interval.num_draft_tokens, interval.num_accepted_tokens) == (2, 5, 3)
    assert interval.num_accepted_tokens_per_pos == [1, 1, 1]
    assert interval.mean_acceptance_length == 2.5 and interval.acceptance_rate == 0.6
    total = SpecDecodingStats.total([stats, earlier])
    assert total.num_accepted_tokens_per_pos == [3, 3, 1]
