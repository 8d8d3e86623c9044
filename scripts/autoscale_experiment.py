"""Autoscaling experiment: deploy the raylm Serve app with an autoscaling config, drive a load ramp (up, hold, down)
from concurrent streaming OpenAI clients, and record every second the replica count, requests in flight, TTFT,
inter-token latency and output throughput: a CSV, and one PNG with the series on a shared time axis.

    python scripts/autoscale_experiment.py                        # tiny model, local Ray, ~4 minutes
    python scripts/autoscale_experiment.py --address auto --config my-engine.yaml --peak-clients 64 --max-replicas 8

Needs matplotlib (`pip install matplotlib`). With --address the app is deployed on that cluster (and removed at the
end); the clients run here.
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402
from ray import serve  # noqa: E402

from raylm.cluster.serve.app import build_openai_app, start_serve  # noqa: E402
from raylm.cluster.tools.serving_benchmark import random_prompts  # noqa: E402
from raylm.configs import make_engine_config  # noqa: E402

COLUMNS = ("time_s", "clients", "in_flight", "replicas", "replicas_starting", "ttft_ms", "itl_ms", "output_tok_s")


@dataclass
class Trace:
    """What the clients saw: token arrival times, first-token latencies, gaps between tokens."""

    token_times: list[float] = field(default_factory=list)
    first_tokens: list[tuple[float, float]] = field(default_factory=list)  # (time, TTFT)
    gaps: list[tuple[float, float]] = field(default_factory=list)  # (time, ITL)
    in_flight: int = 0


def target_clients(t: float, args: argparse.Namespace) -> int:
    """The load ramp: up linearly to the peak, hold it, down linearly, then nothing (replicas scale down)."""
    ramp, hold = args.ramp_s, args.hold_s
    if t < ramp:
        return round(args.peak_clients * t / ramp)
    if t < ramp + hold:
        return args.peak_clients
    if t < 2 * ramp + hold:
        return round(args.peak_clients * (2 * ramp + hold - t) / ramp)
    return 0


async def client(url: str, model: str, args: argparse.Namespace, trace: Trace, index: int,
                 stop: asyncio.Event) -> None:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600) as api:
        for prompt in random_prompts(10_000, args.prompt_words, seed=index):
            if stop.is_set():
                return
            trace.in_flight += 1
            start = last = time.monotonic()
            first = True
            try:
                stream = await api.completions.create(model=model, prompt=prompt, max_tokens=args.output_len,
                                                      temperature=0.0, stream=True, extra_body={"ignore_eos": True})
                async for chunk in stream:
                    if not chunk.choices:
                        continue
                    now = time.monotonic()
                    if first:
                        trace.first_tokens.append((now, now - start))
                        first = False
                    else:
                        trace.gaps.append((now, now - last))
                    trace.token_times.append(now)
                    last = now
            finally:
                trace.in_flight -= 1


def replica_counts(deployment: str) -> tuple[int, int]:
    """(running, starting) replicas of the deployment."""
    states = serve.status().applications["raylm"].deployments[deployment].replica_states
    return int(states.get("RUNNING", 0)), int(states.get("STARTING", 0))


async def drive(url: str, model: str, deployment: str, args: argparse.Namespace) -> list[dict[str, float]]:
    trace = Trace()
    clients: list[tuple[asyncio.Task, asyncio.Event]] = []
    rows: list[dict[str, float]] = []
    loop = asyncio.get_running_loop()
    start = time.monotonic()
    total = 2 * args.ramp_s + args.hold_s + args.tail_s
    next_sample = start + 1.0
    while (now := time.monotonic()) - start < total:
        wanted = target_clients(now - start, args)
        while len(clients) < wanted:
            stop = asyncio.Event()
            clients.append((asyncio.create_task(client(url, model, args, trace, len(clients), stop)), stop))
        while len(clients) > wanted:
            clients.pop()[1].set()  # it finishes its request, then stops
        if now >= next_sample:
            window = (next_sample - 1.0, next_sample)
            replicas, starting = await loop.run_in_executor(None, replica_counts, deployment)
            ttfts = [v for t, v in trace.first_tokens if window[0] <= t < window[1]]
            gaps = [v for t, v in trace.gaps if window[0] <= t < window[1]]
            rows.append({"time_s": round(next_sample - start, 1), "clients": wanted, "in_flight": trace.in_flight,
                         "replicas": replicas, "replicas_starting": starting,
                         "ttft_ms": 1000 * statistics.mean(ttfts) if ttfts else float("nan"),
                         "itl_ms": 1000 * statistics.mean(gaps) if gaps else float("nan"),
                         "output_tok_s": sum(window[0] <= t < window[1] for t in trace.token_times)})
            print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in rows[-1].items()),
                  flush=True)
            next_sample += 1.0
        await asyncio.sleep(0.1)
    for _, stop in clients:
        stop.set()
    await asyncio.gather(*(task for task, _ in clients), return_exceptions=True)
    return rows


def plot(rows: list[dict[str, float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [row["time_s"] for row in rows]
    fig, axes = plt.subplots(4, 1, sharex=True, figsize=(9, 9))
    axes[0].plot(t, [row["clients"] for row in rows], label="clients")
    axes[0].plot(t, [row["in_flight"] for row in rows], label="requests in flight")
    axes[0].set_ylabel("load")
    replicas = axes[0].twinx()
    replicas.step(t, [row["replicas"] for row in rows], where="post", color="tab:red", label="replicas running")
    replicas.step(t, [row["replicas"] + row["replicas_starting"] for row in rows], where="post", color="tab:red",
                  linestyle=":", label="replicas running + starting")
    replicas.set_ylabel("replicas", color="tab:red")
    replicas.set_ylim(0, max(row["replicas"] + row["replicas_starting"] for row in rows) + 1)
    axes[0].legend(loc="upper left")
    replicas.legend(loc="upper right")
    for axis, key, label in ((axes[1], "ttft_ms", "TTFT (ms)"), (axes[2], "itl_ms", "ITL (ms)"),
                             (axes[3], "output_tok_s", "output tok/s")):
        axis.plot(t, [row[key] for row in rows])
        axis.set_ylabel(label)
    axes[3].set_xlabel("time (s)")
    axes[0].set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", help="Ray cluster to deploy on (default: a new local Ray)")
    parser.add_argument("--config", default="raylm/configs/tiny.yaml", help="engine settings YAML")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--max-replicas", type=int, default=3)
    parser.add_argument("--target-ongoing-requests", type=float, default=2.0)
    parser.add_argument("--upscale-delay-s", type=float, default=5.0)
    parser.add_argument("--downscale-delay-s", type=float, default=15.0)
    parser.add_argument("--peak-clients", type=int, default=8)
    parser.add_argument("--ramp-s", type=float, default=50.0)
    parser.add_argument("--hold-s", type=float, default=50.0)
    parser.add_argument("--tail-s", type=float, default=50.0, help="seconds without load at the end")
    parser.add_argument("--prompt-words", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out-dir", default="docs/autoscale", help="where the CSV and the PNG go")
    args = parser.parse_args()

    config = make_engine_config(args.config, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                                target_ongoing_requests=args.target_ongoing_requests,
                                upscale_delay_s=args.upscale_delay_s, downscale_delay_s=args.downscale_delay_s,
                                disable_log_stats=True)
    # A local Ray declares a CPU per possible replica (and the ingress): the replicas share the real cores.
    ray.init(address=args.address or "local", num_cpus=None if args.address else args.max_replicas + 2,
             include_dashboard=False, log_to_driver=False)
    try:
        start_serve("127.0.0.1", args.port)
        app = build_openai_app(config)
        serve.run(app, name="raylm", route_prefix="/", blocking=False)
        model = config.model_config.served_model_name
        rows = asyncio.run(drive(f"http://127.0.0.1:{args.port}/v1", model, f"LLMServer:{model}", args))
    finally:
        serve.shutdown()
        ray.shutdown()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "autoscale.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    title = (f"{model}: replicas {args.min_replicas}-{args.max_replicas}, target_ongoing_requests "
             f"{args.target_ongoing_requests:g}, upscale/downscale delay {args.upscale_delay_s:g}/"
             f"{args.downscale_delay_s:g} s, peak {args.peak_clients} streaming clients x {args.output_len} tokens")
    plot(rows, out / "autoscale.png", title)
    print(f"wrote {out / 'autoscale.csv'} and {out / 'autoscale.png'}")


if __name__ == "__main__":
    main()
