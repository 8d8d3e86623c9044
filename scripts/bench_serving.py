"""Online serving benchmark: concurrent streaming clients against an OpenAI-compatible /v1/completions.

Starts `raylm serve --no-ray` itself unless --url is given (`raylm bench serve` sweeps a running server); --serve
starts `raylm serve` (the Ray Serve app, on a local Ray) instead, and --compare runs both, one after the other, into
one table. Each client sends its next request as soon as the previous one finishes. Reports time to first token,
inter-token latency and end-to-end latency percentiles and output throughput, each the median over --runs runs.

    python scripts/bench_serving.py --num-clients 8 --num-requests 64 --output-len 32
    python scripts/bench_serving.py --compare
    python scripts/bench_serving.py --url http://127.0.0.1:8000/v1
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from cluster.serving_benchmark import RunResult, percentile, random_prompts, run_concurrency  # noqa: E402


def summarize(runs: list[RunResult]) -> dict[str, list[float]]:
    """Metric -> [p50, p90, p99] in ms (or [tok/s]), each the median over runs."""
    per_run: dict[str, list[list[float]]] = {"TTFT (ms)": [], "ITL (ms)": [], "E2E (ms)": []}
    for run in runs:
        samples = {
            "TTFT (ms)": [r.ttft for r in run.requests],
            "ITL (ms)": [gap for r in run.requests for gap in r.inter_token_latencies],
            "E2E (ms)": [r.e2e for r in run.requests],
        }
        for name, values in samples.items():
            per_run[name].append([1000 * percentile(values, q) for q in (50, 90, 99)])
    summary = {name: [statistics.median(col) for col in zip(*rows)] for name, rows in per_run.items()}
    summary["output tok/s"] = [statistics.median(run.output_throughput for run in runs)]
    return summary


def start_server(args: argparse.Namespace, on_serve: bool) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mode = [] if on_serve else ["--no-ray"]
    command = [sys.executable, "-m", "cluster.cli", "serve", *mode, "--config", args.config, "--port", str(port)]
    if args.model:
        command += ["--model", args.model]
    server = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return server, f"http://127.0.0.1:{port}/v1"
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError("the server did not come up") from None
            time.sleep(0.5)


async def bench(args: argparse.Namespace, url: str) -> tuple[str, dict[str, list[float]]]:
    async with openai.AsyncOpenAI(base_url=url, api_key=os.environ.get("OPENAI_API_KEY", "unused")) as client:
        model = args.served_model or (await client.models.list()).data[0].id
    await run_concurrency(url, model, random_prompts(args.num_clients, args.prompt_words, seed=-1), args.num_clients,
                          args.output_len)  # warm-up
    runs = [await run_concurrency(url, model, random_prompts(args.num_requests, args.prompt_words, args.seed + run),
                                  args.num_clients, args.output_len) for run in range(args.runs)]
    return model, summarize(runs)


def bench_server(args: argparse.Namespace, on_serve: bool) -> tuple[str, dict[str, list[float]]]:
    server, url = start_server(args, on_serve)
    try:
        return asyncio.run(bench(args, url))
    finally:
        server.terminate()
        server.wait(timeout=60)


def print_table(model: str, where: str, summaries: dict[str, dict[str, list[float]]], args: argparse.Namespace) -> None:
    print(f"bench_serving: {model} at {where}; {args.num_clients} clients, {args.num_requests} requests per run, "
          f"{args.prompt_words}-word prompts, {args.output_len} output tokens, median of {args.runs} runs")
    print(f"{'server':<12}{'metric':<14}{'p50':>10}{'p90':>10}{'p99':>10}")
    for server, summary in summaries.items():
        for name in ("TTFT (ms)", "ITL (ms)", "E2E (ms)"):
            print(f"{server:<12}{name:<14}" + "".join(f"{value:>10.1f}" for value in summary[name]))
        print(f"{server:<12}{'output tok/s':<14}{summary['output tok/s'][0]:>10.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="an OpenAI base URL ending in /v1 (default: start a local server)")
    parser.add_argument("--config", default="configs/tiny.yaml", help="settings of the server started here")
    parser.add_argument("--model", help="checkpoint of the server started here (default: the tiny model)")
    parser.add_argument("--served-model", help="model id to request (default: the first in /v1/models)")
    parser.add_argument("--num-clients", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve", action="store_true", help="start `raylm serve` (Ray Serve) instead of --no-ray")
    parser.add_argument("--compare", action="store_true", help="run --no-ray, then --serve, into one table")
    args = parser.parse_args()

    if args.url:
        model, summary = asyncio.run(bench(args, args.url))
        print_table(model, args.url, {"url": summary}, args)
        return
    modes = [False, True] if args.compare else [args.serve]
    summaries: dict[str, dict[str, list[float]]] = {}
    for on_serve in modes:
        model, summaries["ray-serve" if on_serve else "no-ray"] = bench_server(args, on_serve)
    print_table(model, "a local server", summaries, args)
    if args.compare:
        no_ray, on_serve = summaries["no-ray"], summaries["ray-serve"]
        print(f"ray-serve / no-ray: output tok/s {on_serve['output tok/s'][0] / no_ray['output tok/s'][0]:.2f}, "
              f"p50 ITL {on_serve['ITL (ms)'][0] / no_ray['ITL (ms)'][0]:.2f}")

if __name__ == "__main__":
    main()
