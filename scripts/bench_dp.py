"""Data-parallel offline throughput: DP=1 against DP=2 on the same workload, for a tiny dense model and a tiny MoE.

Layouts are run interleaved (one run of each in turn, --runs rounds, after a warm-up run each), so machine noise hits
all of them; the median and spread of each and the ratio to DP=1 are printed beside the machine's fp32 matmul rate.
The MoE model runs as DP=1, as DP=2 independent engines (experts TP-sharded, no expert parallel) and as DP=2 with
expert parallel (lock-step engines: every forward joins the DP all-reduce and the expert all_to_all).

    python scripts/bench_dp.py
    python scripts/bench_dp.py --num-requests 96 --runs 5
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from raylm.cluster import LLM, SamplingParams  # noqa: E402
from raylm.cluster.models.tiny_model import make_tiny_model  # noqa: E402
from scripts.bench_common import matmul_gflops  # noqa: E402

ENGINE = dict(max_model_len=512, max_num_seqs=64, max_num_batched_tokens=2048, enable_prefix_caching=False)
MODELS = {
    "dense (tiny Llama, 0.9M)": dict(arch="llama"),
    "MoE (tiny Mixtral, 4 experts top-2)": dict(arch="mixtral", num_experts=4, num_experts_per_tok=2),
}
LAYOUTS: dict[str, dict[str, dict[str, Any]]] = {
    "dense (tiny Llama, 0.9M)": {"DP=1": {}, "DP=2": {"data_parallel_size": 2}},
    "MoE (tiny Mixtral, 4 experts top-2)": {
        "DP=1": {},
        "DP=2": {"data_parallel_size": 2},
        "DP=2 + EP (lock-step)": {"data_parallel_size": 2, "enable_expert_parallel": True},
    },
}


def workload(num_requests: int, seed: int = 0) -> tuple[list[dict], list[SamplingParams], int]:
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(5, 2000) for _ in range(rng.randint(16, 256))]}
               for _ in range(num_requests)]
    lens = [rng.randint(16, 128) for _ in range(num_requests)]
    return prompts, [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in lens], sum(lens)


def timed(llm: LLM, prompts: list[dict], params: list[SamplingParams], num_tokens: int) -> float:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == num_tokens
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    prompts, params, num_tokens = workload(args.num_requests)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model_name, spec in MODELS.items():
            path = make_tiny_model(Path(tmp) / spec["arch"], **spec)
            llms = {layout: LLM(model=str(path), **ENGINE, **settings)
                    for layout, settings in LAYOUTS[model_name].items()}
            for llm in llms.values():
                timed(llm, prompts, params, num_tokens)  # warm-up
            times: dict[str, list[float]] = {layout: [] for layout in llms}
            for _ in range(args.runs):
                for layout, llm in llms.items():
                    times[layout].append(timed(llm, prompts, params, num_tokens))
            for llm in llms.values():
                llm.shutdown()
            base = statistics.median(times["DP=1"])
            for layout, samples in times.items():
                median = statistics.median(samples)
                rows.append((model_name, layout, median, min(samples), max(samples), num_tokens / median,
                             base / median))
    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
          f"{torch.__version__}, fp32 2048^2 matmul {matmul_gflops():.0f} GFLOP/s; {args.num_requests} requests, "
          f"prompt 16-256, output 16-128 tokens ({num_tokens} total), greedy fp32, median of {args.runs}")
    print("| model | layout | time (s) | spread (s) | output tok/s | vs DP=1 |")
    print("|---|---|---|---|---|---|")
    for model_name, layout, median, low, high, rate, ratio in rows:
        print(f"| {model_name} | {layout} | {median:.2f} | {low:.2f}-{high:.2f} | {rate:,.0f} | {ratio:.2f}x |")
    ray.shutdown()


if __name__ == "__main__":
    main()
