"""The scheduler driven by a fake model runner: batching, budgets, chunked prefill, prefix caching,
preemption, policies, stop conditions, async scheduling. No model, CPU only."""
from __future__ import annotations

import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from raylm.cluster.core.engine_core_output import EngineCoreOutput
from raylm.cluster.core.request import Request, RequestStatus
from raylm.cluster.core.scheduler import Scheduler
from raylm.common.outputs import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from raylm.common.sampling_params import SamplingParams
from raylm.configs.engine_config import CacheConfig, SchedulerConfig

BLOCK_SIZE = 4
EOS = 2


def position_token(req_id: str, position: int) -> int:
    return 1000 + position  # depends only on the position: recomputation must reproduce it


@dataclass
class _RunnerRequest:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


class FakeRunner:
    """Keeps the state a model runner keeps, built from SchedulerOutput diffs only, checks it, and
    samples `sample(req_id, position)` for every request whose known tokens are all computed."""

    def __init__(self, sample: Callable[[str, int], int] = position_token) -> None:
        self.sample = sample
        self.requests: dict[str, _RunnerRequest] = {}
        self.outputs: list[SchedulerOutput] = []

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.outputs.append(out)
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.requests, f"{new.req_id} sent twice"
            self.requests[new.req_id] = _RunnerRequest(
                new.prompt_token_ids + new.output_token_ids, list(new.block_ids), new.num_computed_tokens)
        cached = out.scheduled_cached_reqs
        for req_id, block_ids, num_computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            state = self.requests[req_id]
            assert state.num_computed_tokens == num_computed
            state.block_ids += block_ids
        assert set(out.num_scheduled_tokens) == {r.req_id for r in out.scheduled_new_reqs} | set(cached.req_ids)
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())

        req_ids, sampled = [], []
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            state = self.requests[req_id]
            assert num_tokens > 0
            state.num_computed_tokens += num_tokens
            assert state.num_computed_tokens <= len(state.token_ids)
            assert len(state.block_ids) * BLOCK_SIZE >= state.num_computed_tokens
            req_ids.append(req_id)
            if state.num_computed_tokens == len(state.token_ids):
                token = self.sample(req_id, len(state.token_ids))
                state.token_ids.append(token)
                sampled.append([token])
            else:
                sampled.append([])
        self._check_block_sharing()
        return ModelRunnerOutput(req_ids, sampled)

    def _check_block_sharing(self) -> None:
        """A block held by two requests must be a full, computed block with the same tokens in both."""
        contents: dict[int, tuple[int, ...] | None] = {}
        for state in self.requests.values():
            for i, block_id in enumerate(state.block_ids):
                end = (i + 1) * BLOCK_SIZE
                content = tuple(state.token_ids[i * BLOCK_SIZE:end]) if end <= state.num_computed_tokens else None
                if block_id in contents:
                    assert content is not None and contents[block_id] == content, f"block {block_id} clobbered"
                contents[block_id] = content


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


def make_scheduler(
    num_blocks: int = 64,
    max_model_len: int = 128,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    scheduling_policy: str = "fcfs",
    enable_prefix_caching: bool = True,
    async_scheduling: bool = False,
    send_token_ids: bool = False,
) -> Scheduler:
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
        enable_chunked_prefill=enable_chunked_prefill, long_prefill_token_threshold=long_prefill_token_threshold,
        scheduling_policy=scheduling_policy,
        async_scheduling=async_scheduling)
    cache_config = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=enable_prefix_caching)
    return Scheduler(scheduler_config, cache_config, max_model_len, num_blocks, BLOCK_SIZE, send_token_ids)


def make_request(
    req_id: str, prompt: list[int] | int, max_tokens: int | None = 8, priority: int = 0,
    arrival_time: float | None = None, **params,
) -> Request:
    if isinstance(prompt, int):  # distinct prompts for distinct ids: no accidental prefix hits
        start = 10_000 + 1_000 * (zlib.crc32(req_id.encode()) % 10_000)
        prompt = list(range(start, start + prompt))
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, **params), {EOS},
                   arrival_time=arrival_time, priority=priority)


def collect(results: dict[str, Result], outputs: list[EngineCoreOutput]) -> None:
    for output in outputs:
        result = results.setdefault(output.request_id, Result())
        assert result.finish_reason is None, f"{output.request_id} got output after finishing"
        result.token_ids += output.new_token_ids
        result.finish_reason, result.stop_reason = output.finish_reason, output.stop_reason
        result.num_cached_tokens = output.num_cached_tokens


def run(scheduler: Scheduler, runner: FakeRunner, depth: int = 1, max_steps: int = 1000,
        results: dict[str, Result] | None = None) -> dict[str, Result]:
    """Drive to completion with `depth` steps in flight (depth 2: the next step is scheduled before
    the previous one's output is back, as with async scheduling or a PP batch queue)."""
    results = {} if results is None else results
    in_flight: list[SchedulerOutput] = []
    for _ in range(max_steps):
        if scheduler.has_unfinished_requests() and len(in_flight) < depth:
            out = scheduler.schedule()
            assert out.total_num_scheduled_tokens <= scheduler.max_num_batched_tokens
            assert scheduler.num_running <= scheduler.max_num_seqs
            in_flight.append(out)
        elif in_flight:
            out = in_flight.pop(0)
            collect(results, scheduler.update_from_output(out, runner.execute(out)))
        else:
            break
    assert not scheduler.has_unfinished_requests() and not in_flight, "did not finish"
    assert_pool_empty(scheduler)
    return results


def assert_pool_empty(scheduler: Scheduler) -> None:
    manager = scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks and scheduler.kv_cache_usage == 0.0
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)
    assert manager.req_to_blocks == {}


def expected_tokens(request: Request, count: int) -> list[int]:
    return [position_token(request.request_id, request.num_prompt_tokens + i) for i in range(count)]


def step(scheduler: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    out = scheduler.schedule()
    return out, scheduler.update_from_output(out, runner.execute(out))


def test_continuous_batching_admits_while_decoding() -> None:
    scheduler, runner = make_scheduler(), FakeRunner()
    first = make_request("a", 10, max_tokens=20)
    scheduler.add_request(first)
    for _ in range(3):
        step(scheduler, runner)
    scheduler.add_request(make_request("b", 12))
    out, outputs = step(scheduler, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 12}
    assert out.scheduled_cached_reqs.req_ids == ["a"] and [r.req_id for r in out.scheduled_new_reqs] == ["b"]
    assert {o.request_id for o in outputs} == {"a", "b"}
    results = run(scheduler, runner)
    assert len(results["b"].token_ids) == 7 and results["b"].finish_reason == "length"


def test_token_budget_and_max_num_seqs() -> None:
    scheduler, runner = make_scheduler(max_num_batched_tokens=16, max_num_seqs=3), FakeRunner()
    requests = [make_request(f"r{i}", 5 + 3 * i, max_tokens=4 + i) for i in range(6)]
    for request in requests:
        scheduler.add_request(request)
    results = run(scheduler, runner)
    assert max(out.total_num_scheduled_tokens for out in runner.outputs) == 16
    for request in requests:
        assert results[request.request_id].token_ids == expected_tokens(request, request.max_tokens)


def test_chunked_prefill_splits_a_long_prompt() -> None:
    scheduler, runner = make_scheduler(max_num_batched_tokens=32), FakeRunner()
    request = make_request("a", 100, max_tokens=3)
    scheduler.add_request(request)
    chunks = []
    for _ in range(4):
        out, outputs = step(scheduler, runner)
        chunks.append(out.num_scheduled_tokens["a"])
        assert (outputs == []) == (len(chunks) < 4)  # only the last chunk samples
    assert chunks == [32, 32, 32, 4]
    assert run(scheduler, runner)["a"].token_ids == expected_tokens(request, 3)[1:]


def test_long_prefill_token_threshold_slices_a_prompt_beside_the_decodes() -> None:
    scheduler, runner = make_scheduler(long_prefill_token_threshold=8), FakeRunner()
    decoding, long = make_request("a", 4, max_tokens=20), make_request("b", 20, max_tokens=3)
    scheduler.add_request(decoding)
    step(scheduler, runner)  # a's 4-token prompt: under the threshold, whole
    scheduler.add_request(long)
    steps = [step(scheduler, runner)[0].num_scheduled_tokens for _ in range(3)]
    assert steps == [{"a": 1, "b": 8}, {"a": 1, "b": 8}, {"a": 1, "b": 4}]  # the budget (64) would take b at once
    results = run(scheduler, runner)
    assert results["b"].token_ids == expected_tokens(long, 3)[1:]  # its first token came with the last slice
    assert len(results["a"].token_ids) == 20 - 4


def test_without_chunked_prefill_a_prompt_waits_for_room() -> None:
    scheduler = make_scheduler(max_model_len=64, max_num_batched_tokens=64, enable_chunked_prefill=False)
    runner = FakeRunner()
    scheduler.add_request(make_request("a", 40))
    scheduler.add_request(make_request("b", 40))
    out, _ = step(scheduler, runner)
    assert out.num_scheduled_tokens == {"a": 40}
    out, _ = step(scheduler, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 40}
    run(scheduler, runner)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_scheduler(max_model_len=128, max_num_batched_tokens=64, enable_chunked_prefill=False)


@pytest.mark.parametrize("when", ["waiting", "mid_prefill", "mid_decode", "in_flight"])
def test_abort_returns_every_block(when: str) -> None:
    scheduler, runner = make_scheduler(max_num_batched_tokens=8), FakeRunner()
    scheduler.add_request(make_request("a", 20, max_tokens=50))
    scheduler.add_request(make_request("b", 6))
    if when == "mid_prefill":
        step(scheduler, runner)
    elif when == "mid_decode":
        for _ in range(5):
            step(scheduler, runner)
    if when == "in_flight":
        out = scheduler.schedule()
        scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
        assert scheduler.update_from_output(out, runner.execute(out)) == []
    else:
        scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    scheduler.finish_requests(["a", "unknown"], RequestStatus.FINISHED_ABORTED)  # idempotent
    assert "a" not in scheduler.requests and scheduler.get_num_unfinished_requests() == 1
    assert "a" in scheduler.schedule().finished_req_ids
    scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished_requests() and scheduler.num_running == scheduler.num_waiting == 0
    assert_pool_empty(scheduler)


def test_prefix_caching_shares_and_reuses_blocks() -> None:
    scheduler, runner = make_scheduler(), FakeRunner()
    prefix = list(range(500, 512))  # three full blocks
    scheduler.add_request(make_request("a", prefix + [1, 2], max_tokens=10))
    step(scheduler, runner)
    scheduler.add_request(make_request("b", prefix + [3, 4, 5]))
    out, _ = step(scheduler, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 3}
    assert out.scheduled_new_reqs[0].num_computed_tokens == 12
    manager = scheduler.kv_cache_manager
    shared = manager.get_block_ids("b")[:3]
    assert shared == manager.get_block_ids("a")[:3]
    assert all(manager.block_pool.blocks[i].ref_cnt == 2 for i in shared)
    assert scheduler.prefix_cache_hits == 12 and scheduler.prefix_cache_queries == 14 + 15
    results = run(scheduler, runner)
    assert results["b"].num_cached_tokens == 12 and results["a"].num_cached_tokens == 0

    # Freed blocks stay cached: a later request reuses them without recomputation.
    scheduler.add_request(make_request("c", prefix + [9]))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"c": 1} and out.scheduled_new_reqs[0].block_ids[:3] == shared
    assert scheduler.reset_prefix_cache() is False
    scheduler.update_from_output(out, runner.execute(out))
    run(scheduler, runner)
    assert scheduler.reset_prefix_cache() is True
    scheduler.add_request(make_request("d", prefix + [9]))
    assert scheduler.schedule().num_scheduled_tokens == {"d": 13}


def test_parallel_samples_share_the_prompt_in_one_step() -> None:
    scheduler, runner = make_scheduler(), FakeRunner()
    prompt = list(range(300, 317))
    for i in range(3):
        scheduler.add_request(make_request(f"p{i}", prompt, temperature=1.0))
    out, _ = step(scheduler, runner)
    assert out.num_scheduled_tokens == {"p0": 17, "p1": 1, "p2": 1}
    run(scheduler, runner)


def _preemption_run(policy: str, priorities: list[int]) -> tuple[list[str], dict[str, Result], list[Request]]:
    # 3 requests of 8 prompt tokens growing to 19 tokens (5 blocks each) in a pool of 10 blocks.
    scheduler, runner = make_scheduler(num_blocks=10, scheduling_policy=policy), FakeRunner()
    requests = [make_request(name, 8, max_tokens=12, priority=priority, arrival_time=float(i))
                for i, (name, priority) in enumerate(zip("abc", priorities))]
    for request in requests:
        scheduler.add_request(request)
    results = run(scheduler, runner)
    assert scheduler.num_preemptions > 0
    preempted = preempted_ids(runner)
    resumed = [new for out in runner.outputs for new in out.scheduled_new_reqs if new.output_token_ids]
    assert resumed, "a preempted request is resumed with its output tokens so far"
    for request in requests:  # recomputation reproduces exactly what an unpreempted run gives
        assert results[request.request_id].token_ids == expected_tokens(request, 12)
        assert results[request.request_id].finish_reason == "length"
    return preempted, results, requests


def preempted_ids(runner: FakeRunner) -> list[str]:
    """In order: requests the runner was told to drop and later got again (as new), i.e. preempted."""
    order = []
    for i, out in enumerate(runner.outputs):
        later = {new.req_id for o in runner.outputs[i:] for new in o.scheduled_new_reqs}
        order += sorted(out.finished_req_ids & later)
    return order


def test_preemption_fcfs_preempts_the_latest() -> None:
    preempted, _, _ = _preemption_run("fcfs", [0, 0, 0])
    assert preempted[0] == "c"


def test_preemption_priority_preempts_the_least_urgent() -> None:
    preempted, _, _ = _preemption_run("priority", [5, 0, 1])
    assert preempted[0] == "a"


def test_priority_policy_admits_by_priority_then_arrival() -> None:
    scheduler = make_scheduler(max_num_seqs=1, scheduling_policy="priority")
    runner = FakeRunner()
    for i, (name, priority) in enumerate([("w", 3), ("x", 1), ("y", 2), ("z", 1)]):
        scheduler.add_request(make_request(name, 5, max_tokens=2, priority=priority, arrival_time=float(i)))
    run(scheduler, runner)
    admitted = [new.req_id for out in runner.outputs for new in out.scheduled_new_reqs]
    assert admitted == ["x", "z", "y", "w"]


def test_request_validation() -> None:
    scheduler = make_scheduler(num_blocks=4, max_model_len=64)
    with pytest.raises(ValueError, match=r"10 prompt tokens.*need 8 blocks.*pool has 4"):
        scheduler.add_request(make_request("big", 10, max_tokens=20))  # 29 slots: 8 blocks
    with pytest.raises(ValueError, match=r"64 tokens.*max_model_len is 64"):
        scheduler.add_request(make_request("long", 64))
    with pytest.raises(ValueError, match="empty"):
        scheduler.add_request(make_request("empty", []))
    ok = make_request("ok", 10, max_tokens=7)  # 16 slots: exactly 4 blocks
    scheduler.add_request(ok)
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("ok", 10, max_tokens=7))
    assert run(scheduler, FakeRunner())["ok"].token_ids == expected_tokens(ok, 7)


def eos_at(position: int) -> Callable[[str, int], int]:
    return lambda req_id, pos: EOS if pos >= position else position_token(req_id, pos)


@pytest.mark.parametrize(("params", "sample", "num_tokens", "finish_reason", "stop_reason"), [
    ({}, eos_at(7), 4, "stop", None),
    ({"ignore_eos": True}, eos_at(7), 8, "length", None),
    ({"min_tokens": 5}, eos_at(5), 6, "stop", None),
    ({"stop_token_ids": [1006]}, position_token, 3, "stop", 1006),
    ({"min_tokens": 4, "stop_token_ids": [1006]}, position_token, 8, "length", None),
    ({}, position_token, 8, "length", None),
    ({"max_tokens": None}, position_token, 36, "length", None),  # capped by max_model_len
])
def test_stop_conditions(params: dict, sample: Callable[[str, int], int], num_tokens: int,
                         finish_reason: str, stop_reason: int | None) -> None:
    scheduler = make_scheduler(max_model_len=40)
    request = make_request("a", 4, **{"max_tokens": 8, **params})
    scheduler.add_request(request)
    result = run(scheduler, FakeRunner(sample))["a"]
    assert len(result.token_ids) == num_tokens
    assert (result.finish_reason, result.stop_reason) == (finish_reason, stop_reason)
    if finish_reason == "stop":
        assert result.token_ids[-1] == (stop_reason or EOS)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_two_steps_in_flight(async_scheduling: bool) -> None:
    """Async scheduling (placeholders) and a PP-style batch queue (non-async, depth 2), under
    preemption: outputs of steps scheduled before a preemption are dropped, never duplicated."""
    scheduler = make_scheduler(num_blocks=12, max_num_batched_tokens=16, async_scheduling=async_scheduling)
    runner = FakeRunner()
    requests = [make_request(name, 9, max_tokens=14, arrival_time=float(i)) for i, name in enumerate("abcd")]
    for request in requests:
        scheduler.add_request(request)
    results = run(scheduler, runner, depth=2)
    assert scheduler.num_preemptions > 0
    for request in requests:
        assert results[request.request_id].token_ids == expected_tokens(request, 14)
    decodes = [out for out in runner.outputs if out.scheduled_cached_reqs.req_ids]
    if async_scheduling:  # a request decodes in consecutive steps without waiting for its token
        assert any(set(a.scheduled_cached_reqs.req_ids) & set(b.scheduled_cached_reqs.req_ids)
                   for a, b in zip(decodes, decodes[1:]))


def test_send_token_ids() -> None:
    scheduler, runner = make_scheduler(send_token_ids=True), FakeRunner()
    request = make_request("a", 5, max_tokens=3)
    scheduler.add_request(request)
    step(scheduler, runner)
    out, _ = step(scheduler, runner)
    assert out.scheduled_cached_reqs.new_token_ids == [expected_tokens(request, 1)]
    out, _ = step(scheduler, runner)
    assert out.scheduled_cached_reqs.new_token_ids == [expected_tokens(request, 2)[1:]]
    quiet, quiet_runner = make_scheduler(), FakeRunner()
    quiet.add_request(make_request("a", 5, max_tokens=3))
    step(quiet, quiet_runner)
    assert step(quiet, quiet_runner)[0].scheduled_cached_reqs.new_token_ids == [[]]


@pytest.mark.parametrize(("policy", "priorities", "victim"), [
    ("fcfs", (0, 0), "second"),  # the later arrival preempts itself
    ("priority", (5, 0), "first"),  # the less urgent one, though already scheduled this step
])
def test_preemption_victim_within_a_step(policy: str, priorities: tuple[int, int], victim: str) -> None:
    # 7 blocks: both grow to 3 blocks; at 13 computed tokens the first takes the last free block and
    # the second finds none.
    scheduler, runner = make_scheduler(num_blocks=7, scheduling_policy=policy), FakeRunner()
    first = make_request("first", 8, max_tokens=10, priority=priorities[0])
    second = make_request("second", 9, max_tokens=10, priority=priorities[1])
    results: dict[str, Result] = {}
    scheduler.add_request(first)
    collect(results, step(scheduler, runner)[1])
    scheduler.add_request(second)
    while scheduler.num_preemptions == 0:
        out, outputs = step(scheduler, runner)
        collect(results, outputs)
    survivor = "first" if victim == "second" else "second"
    assert out.num_scheduled_tokens == {survivor: 1} and out.total_num_scheduled_tokens == 1
    assert out.finished_req_ids == {victim} and scheduler.requests[victim].status == RequestStatus.PREEMPTED
    run(scheduler, runner, results=results)
    for request in (first, second):
        assert results[request.request_id].token_ids == expected_tokens(request, 10)


def test_abort_waiting_under_priority_policy() -> None:
    scheduler = make_scheduler(max_num_seqs=1, scheduling_policy="priority")
    for name, priority in [("a", 0), ("b", 2), ("c", 1)]:
        scheduler.add_request(make_request(name, 5, priority=priority))
    scheduler.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    runner = FakeRunner()
    run(scheduler, runner)
    assert [new.req_id for out in runner.outputs for new in out.scheduled_new_reqs] == ["a", "b"]


def test_async_scheduling_stops_at_max_tokens_without_extra_steps() -> None:
    scheduler, runner = make_scheduler(async_scheduling=True), FakeRunner()
    request = make_request("a", 5, max_tokens=3)
    scheduler.add_request(request)
    assert run(scheduler, runner, depth=2)["a"].token_ids == expected_tokens(request, 3)
    assert sum("a" in out.num_scheduled_tokens for out in runner.outputs) == 3


def test_logprobs_pass_through_and_stop_mid_output() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 5, logprobs=1))
    out = scheduler.schedule()
    logprobs = LogprobsLists([[7, 7], [EOS, 7], [9, 7]], [[-0.1, -0.1], [-0.2, -0.3], [-0.5, -0.1]], [1, 1, 2])
    # Three tokens in one step (as speculative decoding would give): the EOS ends it, the rest is dropped.
    [output] = scheduler.update_from_output(out, ModelRunnerOutput(["a"], [[7, EOS, 9]], {"a": logprobs}))
    assert output.new_token_ids == [7, EOS] and output.finish_reason == "stop"
    assert output.new_logprobs == LogprobsLists([[7, 7], [EOS, 7]], [[-0.1, -0.1], [-0.2, -0.3]], [1, 1])
    assert_pool_empty(scheduler)


@pytest.mark.parametrize("seed", range(40))
def test_randomized_invariants(seed: int) -> None:
    """Random configs, arrivals and aborts over a small pool: every surviving request gets exactly
    its max_tokens tokens as an undisturbed run would, and every block comes back."""
    rng = random.Random(seed)
    chunked = rng.random() < 0.7
    async_scheduling = rng.random() < 0.4
    depth = 2 if async_scheduling or rng.random() < 0.3 else 1
    scheduler = make_scheduler(
        num_blocks=rng.randint(12, 40), max_model_len=48,
        max_num_batched_tokens=rng.randint(4, 64) if chunked else rng.randint(48, 80),
        max_num_seqs=rng.randint(1, 6), enable_chunked_prefill=chunked,
        scheduling_policy=rng.choice(["fcfs", "priority"]), enable_prefix_caching=rng.random() < 0.7,
        async_scheduling=async_scheduling)
    runner = FakeRunner()
    prefixes = [[rng.randint(3, 99) for _ in range(rng.randint(0, 20))] for _ in range(3)]
    pending = []
    for i in range(14):
        prompt = rng.choice(prefixes) + [rng.randint(3, 99) for _ in range(rng.randint(1, 20))]
        pending.append(make_request(f"r{i}", prompt, max_tokens=rng.randint(1, 20), priority=rng.randint(0, 3),
                                    arrival_time=float(i)))
    results: dict[str, Result] = {}
    accepted, aborted = [], set()
    in_flight: list[SchedulerOutput] = []
    for _ in range(3000):
        if pending and rng.random() < 0.3:
            request = pending.pop(0)
            try:
                scheduler.add_request(request)
                accepted.append(request)
            except ValueError:
                blocks = scheduler.kv_cache_manager.blocks_needed(request.num_prompt_tokens + request.max_tokens - 1)
                assert blocks > scheduler.kv_cache_manager.num_blocks
        if scheduler.requests and rng.random() < 0.03:
            victim = rng.choice(sorted(scheduler.requests))
            scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            aborted.add(victim)
        if scheduler.has_unfinished_requests() and len(in_flight) < depth:
            in_flight.append(scheduler.schedule())
        elif in_flight:
            out = in_flight.pop(0)
            collect(results, scheduler.update_from_output(out, runner.execute(out)))
        elif not pending:
            break
        manager = scheduler.kv_cache_manager
        in_use = {block.block_id for blocks in manager.req_to_blocks.values() for block in blocks}
        assert manager.num_free_blocks + len(in_use) == manager.num_blocks
        assert set(manager.req_to_blocks) == {request.request_id for request in scheduler.running}
    assert not pending and not scheduler.has_unfinished_requests() and not in_flight
    assert_pool_empty(scheduler)
    for request in accepted:
        if request.request_id not in aborted:
            assert results[request.request_id].token_ids == expected_tokens(request, request.max_tokens)
            assert results[request.request_id].finish_reason == "length"
