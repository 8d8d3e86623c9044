"""AsyncLLM: the engine thread behind the asyncio frontends."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from raylm.cluster.engine.async_llm import AsyncLLM
from raylm.cluster.engine.outputs import EngineDeadError, RequestOutput
from raylm.cluster.engine.stats import IterationStats, SchedulerStats
from raylm.common.sampling_params import SamplingParams
from raylm.configs import EngineConfig, make_engine_config


def _async_llm(model: Path) -> AsyncLLM:
    return AsyncLLM(make_engine_config(model=str(model), max_model_len=128, num_gpu_blocks_override=64,
                                       distributed_executor_backend="uni"))


@pytest.fixture(scope="module")
def llm(llama_path: Path) -> Iterator[AsyncLLM]:
    llm = _async_llm(llama_path)
    yield llm
    llm.shutdown()


async def _collect(llm: AsyncLLM, request_id: str, prompt: Any, params: SamplingParams) -> list[RequestOutput]:
    await llm.wait_until_ready()
    return [output async for output in llm.generate(request_id, prompt, params)]


def test_concurrent_requests_stream_deltas(llm: AsyncLLM) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def run() -> list[list[RequestOutput]]:
        return await asyncio.gather(*[_collect(llm, f"delta-{i}", f"prompt {i}", params) for i in range(8)])

    for outputs in asyncio.run(run()):
        assert [len(o.outputs[0].token_ids) for o in outputs] == [1] * 6
        assert [o.finished for o in outputs] == [False] * 5 + [True]
        assert outputs[-1].outputs[0].finish_reason == "length"


def test_final_only_output_is_the_whole_stream(llm: AsyncLLM) -> None:
    """output_kind="final": one output per request, the streamed deltas joined (n=2 sequences, their logprobs), with
    the time of its first token, which came out halfway through the stream of the same request run beside it."""
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=7, n=2, logprobs=2, ignore_eos=True)

    async def run() -> tuple[list[tuple[float, RequestOutput]], list[RequestOutput], float]:
        await llm.wait_until_ready()
        start = time.monotonic()

        async def timed(outputs: Any) -> list[tuple[float, RequestOutput]]:
            return [(time.monotonic(), output) async for output in outputs]

        streamed, final = await asyncio.gather(
            timed(llm.generate("streamed", "Once upon", params)),
            _collect_final(llm.generate("final", "Once upon", params, output_kind="final")))
        return streamed, final, start

    streamed, final, start = asyncio.run(run())
    assert len(streamed) > 6 and len(final) == 1 and final[0].finished
    for index, completion in enumerate(final[0].outputs):
        deltas = [c for _, output in streamed for c in output.outputs if c.index == index]
        assert completion.index == index
        assert completion.token_ids == [t for c in deltas for t in c.token_ids] and len(completion.token_ids) == 12
        assert completion.text == "".join(c.text for c in deltas)
        streamed_logprobs = [lp for c in deltas for lp in c.logprobs or []]  # the same up to batch-shape rounding
        assert completion.logprobs is not None and len(completion.logprobs) == len(streamed_logprobs) == 12
        for got, want in zip(completion.logprobs, streamed_logprobs, strict=True):
            assert list(got) == list(want) and list(got.values()) == pytest.approx(list(want.values()), abs=1e-4)
        assert completion.finish_reason == deltas[-1].finish_reason == "length"
    first_token_time = final[0].first_token_time
    assert first_token_time is not None and start < first_token_time < streamed[len(streamed) // 2][0]


async def _collect_final(outputs: Any) -> list[RequestOutput]:
    return [output async for output in outputs]


class RecordingStatLogger:
    """A stat logger keeping what the engine thread reports (its figures feed the metrics and the log line)."""

    def __init__(self) -> None:
        self.iterations: list[IterationStats] = []

    def engine_started(self, config: EngineConfig) -> None:
        pass

    def record(self, engine_index: int, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self.iterations.append(iteration_stats)


def test_final_only_request_metrics_time_its_first_token(llm: AsyncLLM) -> None:
    """A final-only request's time to first token and decode time still come from its first token, not from the
    one output at the end. Its stats are told apart by their token count: an earlier test's last step may be
    recorded after this one's recorder is attached."""
    recorder = RecordingStatLogger()
    llm.stat_loggers.append(recorder)
    tokens = 13
    try:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        outputs = asyncio.run(_collect_final(_ready_then(llm, llm.generate("timed", "Once", params,
                                                                           output_kind="final"))))

        def ours() -> list[IterationStats]:  # the step it finished in, which also timed its first token
            return [it for it in recorder.iterations
                    if any(f.num_generation_tokens == tokens for f in it.finished_requests)]

        # The engine thread records a step's stats after it hands out the step's outputs.
        deadline = time.monotonic() + 10
        while not ours() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        llm.stat_loggers.remove(recorder)
    assert len(outputs) == 1
    [iteration] = ours()
    [finished] = [f for f in iteration.finished_requests if f.num_generation_tokens == tokens]
    assert finished.decode_time > 0
    ttft = finished.e2e_latency - finished.decode_time
    assert 0 < ttft < finished.e2e_latency
    assert any(t == pytest.approx(ttft) for t in iteration.time_to_first_tokens)


async def _ready_then(llm: AsyncLLM, outputs: Any) -> Any:
    await llm.wait_until_ready()
    async for output in outputs:
        yield output


def test_bad_input_fails_only_its_request(llm: AsyncLLM) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        asyncio.run(_collect(llm, "too-long", {"prompt_token_ids": [5] * 200}, SamplingParams()))
    outputs = asyncio.run(_collect(llm, "after", "still fine", SamplingParams(max_tokens=2, ignore_eos=True)))
    assert outputs[-1].finished and sum(len(o.outputs[0].token_ids) for o in outputs) == 2


def test_consumer_that_stops_aborts_its_request(llm: AsyncLLM) -> None:
    async def run() -> None:
        await llm.wait_until_ready()
        stream = llm.generate("stops-early", "Once", SamplingParams(max_tokens=100, ignore_eos=True))
        await anext(stream)
        while llm.scheduler_stats.kv_cache_usage == 0:  # the snapshot lags the first output by a step
            await asyncio.sleep(0.001)
        assert llm.scheduler_stats.num_running_reqs == 1
        await stream.aclose()

    asyncio.run(run())
    deadline = time.monotonic() + 5
    while llm.scheduler_stats.kv_cache_usage > 0 or llm.scheduler_stats.num_running_reqs:
        assert time.monotonic() < deadline, "the aborted request kept its blocks"
        time.sleep(0.01)


def test_idle_engine_does_not_step(llm: AsyncLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    asyncio.run(llm.wait_until_ready())
    engine = llm._engine
    assert engine is not None
    steps = 0
    real_step = engine.step

    def counting_step() -> list[RequestOutput]:
        nonlocal steps
        steps += 1
        return real_step()

    monkeypatch.setattr(engine, "step", counting_step)
    time.sleep(0.3)
    assert steps == 0
    asyncio.run(_collect(llm, "wakes-it", "hello", SamplingParams(max_tokens=3, ignore_eos=True)))
    assert steps >= 3


def test_step_error_fails_every_request_and_kills_the_engine(llama_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    llm = _async_llm(llama_path)
    try:
        asyncio.run(llm.wait_until_ready())
        engine = llm._engine
        assert engine is not None
        real_step = engine.step
        calls = 0

        def failing_step() -> list[RequestOutput]:
            nonlocal calls
            calls += 1
            if calls == 5:
                raise RuntimeError("device lost")
            return real_step()

        monkeypatch.setattr(engine, "step", failing_step)
        params = SamplingParams(max_tokens=50, ignore_eos=True)

        async def run() -> list[Any]:
            return await asyncio.gather(*[_collect(llm, f"doomed-{i}", "Once", params) for i in range(3)],
                                        return_exceptions=True)

        results = asyncio.run(run())
        assert all(isinstance(r, EngineDeadError) and "device lost" in str(r) for r in results)
        with pytest.raises(EngineDeadError, match="device lost"):
            asyncio.run(llm.check_health())
        with pytest.raises(EngineDeadError):
            asyncio.run(_collect(llm, "late", "Once", params))
    finally:
        llm.shutdown()
