"""Rows/s of batch inference (issue #44): LLM.generate on N rows against the same rows through one processor replica's
code in this process (EngineStageUDF: an AsyncLLM fed max_concurrent_batches batches at once, what Ray Data gives a
replica), then through Ray Data pools of 1 and 2 replicas end to end (replica start-up included; the seconds until
the first batch came out are reported apart).

    python scripts/bench_batch.py [--model PATH] [--rows 256] [--max-tokens 32] [--repeats 2]

Without --model it builds a tiny random Llama. LLM.generate and the in-process replica alternate --repeats times, so
that load on a shared machine hits both alike; the best of each is reported.
"""
from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
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


def time_llm(llm: LLM, rows: int, params: SamplingParams) -> float:
    start = time.perf_counter()
    llm.generate([prompt_of(i) for i in range(rows)], params, use_tqdm=False)
    return time.perf_counter() - start


def time_replica(udf: EngineStageUDF, rows: int, sampling: dict[str, Any], batch_size: int,
                 max_concurrent_batches: int) -> float:
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

    start = time.perf_counter()
    asyncio.run(run())
    return time.perf_counter() - start


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
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-pool", action="store_true", help="skip the Ray Data runs")
    args = parser.parse_args()
    model = args.model or str(make_tiny_model(tempfile.mkdtemp() + "/llama", arch="llama", num_layers=2,
                                              vocab_size=512))
    engine = {"max_model_len": 256, "max_num_seqs": 128, "distributed_executor_backend": "uni",
              "disable_log_stats": True}
    sampling = {"max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True}
    llm = LLM(model=model, **engine)
    udf = EngineStageUDF(make_engine_config(model=model, **engine), apply_chat_template=True,
                         should_continue_on_error=False)
    llm_times, replica_times = [], []
    try:
        time_llm(llm, 16, SamplingParams(**sampling))  # warm-up: kernels planned, caches touched
        time_replica(udf, 16, sampling, args.batch_size, args.max_concurrent_batches)
        for _ in range(args.repeats):
            llm_times.append(time_llm(llm, args.rows, SamplingParams(**sampling)))
            replica_times.append(time_replica(udf, args.rows, sampling, args.batch_size, args.max_concurrent_batches))
    finally:
        llm.shutdown()
        udf.engine.shutdown()
    best_llm, best_replica = min(llm_times), min(replica_times)
    print(f"{args.rows} rows x {args.max_tokens} tokens")
    print(f"LLM.generate:            {args.rows / best_llm:8.1f} rows/s  (runs: {_seconds(llm_times)})")
    print(f"one replica, in process: {args.rows / best_replica:8.1f} rows/s  (runs: {_seconds(replica_times)}) "
          f"= {best_llm / best_replica:.2f}x LLM.generate")
    if args.no_pool:
        return
    ray.init(address="local", num_cpus=8, include_dashboard=False)
    for concurrency in (1, 2):
        total, to_first = time_pool(model, engine, args.rows, sampling, concurrency, args.batch_size,
                                    args.max_concurrent_batches)
        print(f"Ray Data, {concurrency} replica(s):    {args.rows / total:8.1f} rows/s end to end ({total:.1f} s, "
              f"{to_first:.1f} s of it until the first batch came out: replica start-up and that batch)")
    ray.shutdown()


def _seconds(times: list[float]) -> str:
    return ", ".join(f"{t:.2f} s" for t in times)


if __name__ == "__main__":
    main()
