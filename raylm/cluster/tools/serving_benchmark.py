"""`raylm bench serve`: streaming clients against any OpenAI-compatible server, swept over concurrency or request rate.

Each sweep point sends --num-requests completions and reports time to first token (TTFT), inter-token latency (ITL)
and end-to-end latency (E2E) percentiles, and request and output-token throughput: one table, and a JSON file.
A concurrency point keeps N requests in flight (each client sends its next request when one finishes); a rate point
starts requests at Poisson arrival times (`inf`: all at once).

    raylm bench serve --url http://127.0.0.1:8000/v1 --concurrency 1 4 16
    raylm bench serve --url http://127.0.0.1:8000/v1 --request-rate 2 8 inf --output-json sweep.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from openai import AsyncOpenAI

_WORDS = ("time river garden window music forest bridge island mountain letter kitchen engine signal "
          "message answer network model token cloud storm winter summer quiet bright ancient modern").split()
PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    ttft: float
    inter_token_latencies: list[float]
    e2e: float
    output_tokens: int


@dataclass
class RunResult:
    requests: list[RequestResult] = field(default_factory=list)
    wall_time: float = 0.0

    @property
    def output_throughput(self) -> float:
        return sum(r.output_tokens for r in self.requests) / self.wall_time


@dataclass
class SweepPoint:
    """One row of the table: latencies in ms at PERCENTILES, throughputs per second."""

    load: str  # "concurrency 8" or "rate 4.0/s"
    ttft_ms: list[float]
    itl_ms: list[float]
    e2e_ms: list[float]
    request_throughput: float
    output_throughput: float


def random_prompts(count: int, num_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(num_words)) for _ in range(count)]


async def one_request(client: AsyncOpenAI, model: str, prompt: str, output_len: int) -> RequestResult:
    start = time.perf_counter()
    token_times: list[float] = []
    output_tokens = 0
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=output_len, temperature=0.0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.usage is not None:
            output_tokens = chunk.usage.completion_tokens
        if chunk.choices:
            token_times.append(time.perf_counter())
    if not token_times:
        raise RuntimeError("a stream ended without any output")
    gaps = [later - earlier for earlier, later in zip(token_times, token_times[1:])]
    return RequestResult(token_times[0] - start, gaps, token_times[-1] - start, output_tokens)


def _client(url: str) -> AsyncOpenAI:
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=url, api_key=os.environ.get("OPENAI_API_KEY", "unused"), max_retries=0,
                              timeout=600)


async def run_concurrency(url: str, model: str, prompts: list[str], num_clients: int, output_len: int) -> RunResult:
    pending = list(reversed(prompts))
    result = RunResult()

    async def client_loop(client: AsyncOpenAI) -> None:
        while pending:
            result.requests.append(await one_request(client, model, pending.pop(), output_len))

    async with _client(url) as client:
        start = time.perf_counter()
        await asyncio.gather(*[client_loop(client) for _ in range(num_clients)])
        result.wall_time = time.perf_counter() - start
    return result


async def run_rate(url: str, model: str, prompts: list[str], rate: float, output_len: int, seed: int) -> RunResult:
    rng = random.Random(seed)
    result = RunResult()
    async with _client(url) as client:
        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one_request(client, model, prompt, output_len)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        result.requests = list(await asyncio.gather(*tasks))
        result.wall_time = time.perf_counter() - start
    return result


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else math.nan


def summarize(load: str, run: RunResult) -> SweepPoint:
    def ms(values: list[float]) -> list[float]:
        return [1000 * percentile(values, q) for q in PERCENTILES]

    return SweepPoint(load, ms([r.ttft for r in run.requests]),
                      ms([gap for r in run.requests for gap in r.inter_token_latencies]),
                      ms([r.e2e for r in run.requests]), len(run.requests) / run.wall_time, run.output_throughput)


def format_table(points: list[SweepPoint]) -> str:
    header = "| load | TTFT p50/p90/p99 (ms) | ITL p50/p90/p99 (ms) | E2E p50/p90/p99 (ms) | req/s | output tok/s |"
    lines = [header, "|---|---|---|---|---|---|"]
    for p in points:
        def cell(values: list[float]) -> str:
            return " / ".join(f"{v:.1f}" for v in values)

        lines.append(f"| {p.load} | {cell(p.ttft_ms)} | {cell(p.itl_ms)} | {cell(p.e2e_ms)} | "
                     f"{p.request_throughput:.2f} | {p.output_throughput:,.1f} |")
    return "\n".join(lines)


async def sweep(args: argparse.Namespace) -> list[SweepPoint]:
    async with _client(args.url) as client:
        model = args.served_model or (await client.models.list()).data[0].id
    warm_up = random_prompts(4, args.prompt_words, seed=-1)
    await run_concurrency(args.url, model, warm_up, 4, args.output_len)
    points = []
    loads = [("rate", r) for r in args.request_rate] if args.request_rate else [
        ("concurrency", c) for c in args.concurrency]
    for index, (kind, value) in enumerate(loads):
        prompts = random_prompts(args.num_requests, args.prompt_words, args.seed + index)
        if kind == "rate":
            run = await run_rate(args.url, model, prompts, value, args.output_len, args.seed + index)
            label = f"rate {value:g}/s"
        else:
            run = await run_concurrency(args.url, model, prompts, int(value), args.output_len)
            label = f"concurrency {int(value)}"
        points.append(summarize(label, run))
        print(format_table(points[-1:]).splitlines()[-1], flush=True)
    return points


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="the server's OpenAI base URL, ending in /v1")
    parser.add_argument("--served-model", help="model id to request (default: the first in /v1/models)")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8], help="requests in flight")
    load.add_argument("--request-rate", type=float, nargs="+", help="Poisson arrival rates per second (inf: burst)")
    parser.add_argument("--num-requests", type=int, default=64, help="requests per sweep point")
    parser.add_argument("--prompt-words", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", help="also write the table's figures to this JSON file")


def run(args: argparse.Namespace) -> int:
    if any(c < 1 for c in args.concurrency or []) or any(r <= 0 for r in args.request_rate or []):
        raise ValueError("--concurrency values must be >= 1 and --request-rate values > 0")
    print(f"raylm bench serve: {args.url}; {args.num_requests} requests per point, {args.prompt_words}-word "
          f"prompts, {args.output_len} output tokens", flush=True)
    points = asyncio.run(sweep(args))
    print(format_table(points))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"url": args.url, "settings": {k: v for k, v in vars(args).items() if k != "func"},
                       "percentiles": PERCENTILES, "points": [asdict(p) for p in points]}, f, indent=2)
    return 0
