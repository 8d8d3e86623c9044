"""Rows/s of batch inference (issue #44): LLM.generate on N rows against the same rows through one processor replica's
code in this process (EngineStageUDF: an AsyncLLM fed max_concurrent_batches batches at once, what Ray Data gives a
replica, taking each row's final output only), and through the same AsyncLLM streaming a delta per token (what the
replica paid before final-only outputs); then through Ray Data pools of 1 and 2 replicas end to end (replica start-up
included; the seconds until the first batch came out are reported apart).

    python scripts/bench_batch.py [--model PATH] [--rows 256] [--max-tokens 32] [--repeats 5]

Without --model it builds a tiny random Llama. The contenders alternate --repeats times, so that load on a shared
machine hits them alike; the median of each is reported, with the load average before and after.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import ray
import ray.data

from raylm.cluster.batch.engine_stage import EngineStageUDF
from raylm.cluster.entrypoints.llm import LLM
from raylm.cluster.models.tiny_model import make_tiny_model
from raylm.common.sampling_params import SamplingParams
from raylm.configs import make_engine_config
from raylm.data import EngineProcessorConfig, build_processor


def prompt_of(i: int) -> str:
    return f"row {i}: " + " ".join(str(i * k % 89) for k in range(8 + i % 16))


Timing = tuple[float, float]  # wall seconds, CPU seconds of this process (all its threads)


def timed(fn: Callable[[], object]) -> Timing:
    """CPU seconds say what a contender costs even while other jobs take the cores; wall seconds what it took."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def run_llm(llm: LLM, rows: int, params: SamplingParams) -> None:
    llm.generate([prompt_of(i) for i in range(rows)], params, use_tqdm=False)


def run_replica(udf: EngineStageUDF, rows: int, sampling: dict[str, Any], batch_size: int,
                max_concurrent_batches: int) -> None:
    batches = [pa.Table.from_pylist([{"id": i, "prompt": prompt_of(i), "sampling_params": sampling}
                                     for i in range(start, min(start + batch_size, rows))])
               for start in range(0, rows, batch_size)]

    async def run() -> None:
        queue = list(batches)

        async def lane() -> None:  # as Ray Data does: a new batch as soon as one of the lanes is free
            while queue:
                async for _ in udf(queue.pop(0)):
                    pass

        await asyncio.gather(*[lane() for _ in range(max_concurrent_batches)])

    asyncio.run(run())


def run_streaming(udf: EngineStageUDF, rows: int, params: SamplingParams) -> None:
    """Every row in the replica's AsyncLLM at once, each consumed delta by delta (one event-loop wake-up per token)."""
    async def one(i: int) -> None:
        async for _ in udf.engine.generate(f"stream-{i}", prompt_of(i), params):
            pass

    async def run() -> None:
        await asyncio.gather(*[one(i) for i in range(rows)])

    asyncio.run(run())


def time_pool(model: str, engine: dict[str, Any], rows: int, sampling: dict[str, Any], concurrency: int,
              batch_size: int, max_concurrent_batches: int) -> tuple[float, float]:
    config = EngineProcessorConfig(model_source=model, engine_kwargs=engine, concurrency=concurrency,
                                   batch_size=batch_size, max_concurrent_batches=max_concurrent_batches,
                                   placement_group_config={"bundles": [{"CPU": 0.5}]})
    dataset = build_processor(config)(ray.data.from_items(
        [{"id": i, "prompt": prompt_of(i), "sampling_params": sampling} for i in range(rows)]))
    start = time.perf_counter()
    first = None
    count = 0
    for _ in dataset.iter_rows():
        first = first or time.perf_counter()
        count += 1
    assert count == rows
    return time.perf_counter() - start, (first or start) - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-concurrent-batches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-pool", action="store_true", help="skip the Ray Data runs")
    args = parser.parse_args()
    model = args.model or str(make_tiny_model(tempfile.mkdtemp() + "/llama", arch="llama", num_layers=2,
                                              vocab_size=512))
    engine: dict[str, Any] = {"max_model_len": 256, "max_num_seqs": 128, "distributed_executor_backend": "uni",
              "disable_log_stats": True}
    sampling = {"max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True}
    llm = LLM(model=model, **engine)
    udf = EngineStageUDF(make_engine_config(model=model, **engine), apply_chat_template=True,
                         should_continue_on_error=False)
    params = SamplingParams(**sampling)
    contenders: dict[str, Callable[[int], None]] = {
        "LLM.generate": lambda rows: run_llm(llm, rows, params),
        "one replica, in process": lambda rows: run_replica(udf, rows, sampling, args.batch_size,
                                                            args.max_concurrent_batches),
        "AsyncLLM, delta per token": lambda rows: run_streaming(udf, rows, params),
    }
    timings: dict[str, list[Timing]] = {name: [] for name in contenders}
    load_before = os.getloadavg()
    try:
        for run in contenders.values():
            run(16)  # warm-up: kernels planned, caches touched
        for _ in range(args.repeats):
            for name, run in contenders.items():
                timings[name].append(timed(functools.partial(run, args.rows)))
    finally:
        llm.shutdown()
        udf.engine.shutdown()
    print(f"{args.rows} rows x {args.max_tokens} tokens; medians of {args.repeats} interleaved runs; load average "
          f"(1, 5, 15 min) before: {_load(load_before)}, after: {_load(os.getloadavg())}")
    base_wall, base_cpu = (statistics.median(t[k] for t in timings["LLM.generate"]) for k in (0, 1))
    for name, runs in timings.items():
        wall, cpu = (statistics.median(t[k] for t in runs) for k in (0, 1))
        print(f"{name + ':':27} {args.rows / wall:7.1f} rows/s ({base_wall / wall:.2f}x), {cpu:.2f} CPU s "
              f"({base_cpu / cpu:.2f}x); runs: {', '.join(f'{w:.2f} s / {c:.2f} CPU s' for w, c in runs)}")
    if args.no_pool:
        return
    ray.init(address="local", num_cpus=8, include_dashboard=False)
    for concurrency in (1, 2):
        total, to_first = time_pool(model, engine, args.rows, sampling, concurrency, args.batch_size,
                                    args.max_concurrent_batches)
        print(f"Ray Data, {concurrency} replica(s):    {args.rows / total:8.1f} rows/s end to end ({total:.1f} s, "
              f"{to_first:.1f} s of it until the first batch came out: replica start-up and that batch)")
    ray.shutdown()


def _load(load: tuple[float, float, float]) -> str:
    return ", ".join(f"{value:.1f}" for value in load)


if __name__ == "__main__":
    main()
