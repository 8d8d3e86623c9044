"""Across engines, side by side in one run:

(a) multi-turn chat over 2 data-parallel engines, routing_policy load vs prefix: many conversations at once, each
    turn resending the whole history a random think time after the previous answer; prefix-cache hit rate and TTFT
    p50/p99.
(b) a returning conversation whose blocks were evicted from a small KV pool: its TTFT when the OffloadingConnector
    loads them back from the node's host store, against recomputing them.
(c) long prompts arriving among running decodes: the decodes' inter-token latency p50/p99 on one colocated engine
    (the machine's cores) against disaggregated prefill (RayKVConnector: a prefill engine and a decode engine, each in
    its own process with half the cores).

Settings alternate run by run (after a warm-up each); medians over --runs, the machine's matmul rate beside them.

    python scripts/bench_cluster.py                 # all three
    python scripts/bench_cluster.py --only b --runs 5
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from raylm.cluster import LLM, SamplingParams  # noqa: E402
from scripts.bench_common import matmul_gflops, preset_model, vocab_size  # noqa: E402
from scripts.bench_disagg import run_disaggregation  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


# ---- (a) multi-turn chat over two engines -----------------------------------------------------------------------


def chat_run(llm: LLM, args: argparse.Namespace, seed: int) -> tuple[float, list[float]]:
    """Every conversation sends its next turn a random think time (0 to 2 x --think-s) after its answer is done;
    (hit rate, TTFTs in s)."""
    rng = random.Random(seed)
    engine, answer = llm.llm_engine, SamplingParams(temperature=0.0, max_tokens=args.answer_len, ignore_eos=True)
    history = {c: [rng.randrange(5, args.vocab) for _ in range(args.system_len)] for c in range(args.conversations)}
    turns = dict.fromkeys(history, 0)
    sent: dict[str, float] = {}
    ttfts: list[float] = []
    stats_before = engine.engine_core.engine_stats()

    def send(conv: int) -> None:
        history[conv] += [rng.randrange(5, args.vocab) for _ in range(args.user_len)]
        request_id = f"{seed}-{conv}-{turns[conv]}"
        engine.add_request(request_id, {"prompt_token_ids": history[conv]}, answer)
        sent[request_id] = time.perf_counter()

    start = time.perf_counter()
    due = {conv: start + rng.uniform(0, 2 * args.think_s) for conv in history}  # when each sends its next turn
    while due or engine.has_unfinished_requests():
        now = time.perf_counter()
        for conv in [conv for conv, at in due.items() if at <= now]:
            del due[conv]
            send(conv)
        if not engine.has_unfinished_requests():
            time.sleep(0.002)
            continue
        for output in engine.step():
            if output.request_id in sent and output.outputs[0].token_ids:
                ttfts.append(time.perf_counter() - sent.pop(output.request_id))
            if output.finished:
                conv = int(output.request_id.split("-")[1])
                history[conv] += output.outputs[0].token_ids
                turns[conv] += 1
                if turns[conv] < args.turns:
                    due[conv] = time.perf_counter() + rng.uniform(0, 2 * args.think_s)
    stats = engine.engine_core.engine_stats()
    hits = sum(s.prefix_cache_hits for s in stats) - sum(s.prefix_cache_hits for s in stats_before)
    queries = sum(s.prefix_cache_queries for s in stats) - sum(s.prefix_cache_queries for s in stats_before)
    return hits / max(queries, 1), ttfts


def bench_chat(args: argparse.Namespace) -> list[str]:
    model = str(preset_model(args.chat_model))
    args.vocab = vocab_size(Path(model))
    llms = {policy: LLM(model=model, data_parallel_size=2, routing_policy=policy, max_model_len=1024,
                        max_num_seqs=64) for policy in ("load", "prefix")}
    results: dict[str, list[tuple[float, list[float]]]] = {policy: [] for policy in llms}
    for run in range(args.runs + 1):
        for policy, llm in llms.items():
            result = chat_run(llm, args, seed=run)
            if run:  # run 0 warms up
                results[policy].append(result)
    for llm in llms.values():
        llm.shutdown()
    lines = [f"(a) {args.conversations} conversations x {args.turns} turns over 2 DP engines ({args.chat_model} "
             f"model): {args.system_len}-token first prompt, +{args.user_len} user tokens and the {args.answer_len}-"
             f"token answer per turn, each turn 0-{2 * args.think_s:g} s after the last answer",
             "| routing_policy | prefix hit rate | TTFT p50 (ms) | TTFT p99 (ms) |", "|---|---|---|---|"]
    for policy, runs in results.items():
        ttfts = [t for _, run_ttfts in runs for t in run_ttfts]
        lines.append(f"| {policy} | {statistics.median(r for r, _ in runs):.1%} | {percentile(ttfts, 50) * 1e3:.0f} | "
                     f"{percentile(ttfts, 99) * 1e3:.0f} |")
    return lines


# ---- (b) a returning conversation after eviction ------------------------------------------------------------------


def returning_ttft(llm: LLM, args: argparse.Namespace, seed: int) -> float:
    """The conversation's prompt, then enough other prompts to evict it from the pool, then it again: its TTFT."""
    rng = random.Random(seed)
    conversation = {"prompt_token_ids": [rng.randrange(5, args.vocab) for _ in range(args.return_len)]}
    one = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([conversation], one, use_tqdm=False)
    for _ in range(2):  # each fills most of the pool
        llm.generate([{"prompt_token_ids": [rng.randrange(5, args.vocab) for _ in range(args.evict_len)]}], one,
                     use_tqdm=False)
    engine = llm.llm_engine
    start = time.perf_counter()
    engine.add_request(f"back-{seed}", conversation, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    ttft = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if ttft is None and output.outputs[0].token_ids:
                ttft = time.perf_counter() - start
    assert ttft is not None
    return ttft


def bench_offload(args: argparse.Namespace) -> list[str]:
    model = str(preset_model(args.offload_model))
    args.vocab = vocab_size(Path(model))
    blocks = -(-args.evict_len // 16) + 4  # room for one evicting prompt: everything else is evicted
    common = dict(model=model, max_model_len=args.evict_len + 16, num_gpu_blocks_override=blocks)
    llms = {"recompute": LLM(**common), "offload (kv_offloading_size 1 GiB)": LLM(**common, kv_offloading_size=1.0)}
    ttfts: dict[str, list[float]] = {name: [] for name in llms}
    for run in range(args.runs + 1):
        for name, llm in llms.items():
            ttft = returning_ttft(llm, args, seed=1000 + run)
            if run:
                ttfts[name].append(ttft)
    scheduler = llms["offload (kv_offloading_size 1 GiB)"].llm_engine.engine_core.scheduler
    assert scheduler.kv_transfers is not None and scheduler.kv_transfers.num_received_tokens > 0
    for llm in llms.values():
        llm.shutdown()
    lines = [f"(b) a returning {args.return_len}-token conversation after two {args.evict_len}-token prompts evicted "
             f"it from a {blocks}-block pool ({args.offload_model} model), greedy",
             "| KV of the returning prompt | TTFT median (ms) | spread (ms) |", "|---|---|---|"]
    for name, samples in ttfts.items():
        lines.append(f"| {name} | {statistics.median(samples) * 1e3:.1f} | "
                     f"{min(samples) * 1e3:.1f}-{max(samples) * 1e3:.1f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["a", "b", "c"], action="append", help="run only these parts")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--chat-model", default="5m", help="preset of scripts/bench_common.py for (a)")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=384)
    parser.add_argument("--user-len", type=int, default=32)
    parser.add_argument("--answer-len", type=int, default=16)
    parser.add_argument("--think-s", type=float, default=0.5, help="(a): mean pause before the next turn")
    parser.add_argument("--offload-model", default="100m", help="preset for (b)")
    parser.add_argument("--return-len", type=int, default=384)
    parser.add_argument("--evict-len", type=int, default=448)
    parser.add_argument("--pd-model", default="5m", help="preset for (c)")
    parser.add_argument("--num-decodes", type=int, default=8)
    parser.add_argument("--decode-len", type=int, default=96)
    parser.add_argument("--num-long", type=int, default=6)
    parser.add_argument("--long-len", type=int, default=960)
    args = parser.parse_args()
    parts = set(args.only or ["a", "b", "c"])
    torch.set_num_threads(os.cpu_count() or 1)
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    tables = []
    if "a" in parts:
        tables.append(bench_chat(args))
    if "b" in parts:
        tables.append(bench_offload(args))
    if "c" in parts:
        args.vocab = vocab_size(preset_model(args.pd_model))
        tables.append(run_disaggregation(preset_model(args.pd_model), args))
    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__},"
          f" fp32 2048^2 matmul {matmul_gflops():.0f} GFLOP/s, {time.strftime('%Y-%m-%d')}; median of {args.runs} "
          f"runs per setting, interleaved, after a warm-up each")
    for lines in tables:
        print("\n" + "\n".join(lines))
    ray.shutdown()


if __name__ == "__main__":
    main()
