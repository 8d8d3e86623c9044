"""Prefix caching on a shared-system-prompt workload: time to first token and output throughput, cache on and off.

N requests share one long prefix (a system prompt) and differ in a short suffix; all arrive at once, greedy,
ignore_eos. Each setting gets its own LLM and runs once to warm up, then --runs times; every run draws new suffixes.
By default the prefix stays cached from run to run, as a server's system prompt would; with --cold every run starts
from an empty prefix cache, so only sharing within the run counts. The engine is stepped here so that each
request's first token is timed when it appears. Medians over the runs are reported.

    python scripts/bench_prefix.py                  # the tiny default model
    python scripts/bench_prefix.py --model PATH --prefix-len 1024
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raylm.cluster import LLM, SamplingParams  # noqa: E402
from raylm.cluster.models.default_model import build_default_model  # noqa: E402


@dataclass
class RunResult:
    mean_ttft_s: float
    output_tokens_per_s: float


@dataclass
class Workload:
    prefix: list[int]
    num_requests: int
    suffix_len: int
    vocab_size: int
    seed: int

    def prompts(self, run: int) -> list[list[int]]:
        rng = random.Random(self.seed * 1_000_003 + run)
        return [self.prefix + [rng.randrange(5, self.vocab_size) for _ in range(self.suffix_len)]
                for _ in range(self.num_requests)]


def run_once(llm: LLM, prompts: list[list[int]], params: SamplingParams, run: int, cold: bool) -> RunResult:
    engine = llm.llm_engine
    if cold:
        assert llm.reset_prefix_cache(), "the previous run left blocks in use"
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"run{run}-{i}", {"prompt_token_ids": prompt}, params)
    first_token_at: dict[str, float] = {}
    num_output_tokens = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            if output.outputs[0].token_ids:
                first_token_at.setdefault(output.request_id, now)
            if output.finished:
                num_output_tokens += len(output.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    assert len(first_token_at) == len(prompts) and num_output_tokens == len(prompts) * (params.max_tokens or 0)
    return RunResult(statistics.mean(t - start for t in first_token_at.values()), num_output_tokens / elapsed)


def bench(model: str, enable_prefix_caching: bool, workload: Workload, params: SamplingParams, runs: int,
          cold: bool, settings: dict) -> tuple[RunResult, float]:
    """Median TTFT and throughput over the runs, and the prefix-cache hit rate of the timed runs."""
    llm = LLM(model=model, enable_prefix_caching=enable_prefix_caching, **settings)
    scheduler = llm.llm_engine.engine_core.scheduler
    run_once(llm, workload.prompts(0), params, 0, cold)  # warm-up: first-seen shapes are slow
    queries, hits = scheduler.prefix_cache_queries, scheduler.prefix_cache_hits
    results = [run_once(llm, workload.prompts(run), params, run, cold) for run in range(1, runs + 1)]
    hit_rate = (scheduler.prefix_cache_hits - hits) / max(scheduler.prefix_cache_queries - queries, 1)
    llm.shutdown()
    median = RunResult(statistics.median(r.mean_ttft_s for r in results),
                       statistics.median(r.output_tokens_per_s for r in results))
    return median, hit_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder (default: the tiny default model)")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--prefix-len", type=int, default=256)
    parser.add_argument("--suffix-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--cold", action="store_true", help="empty the prefix cache before every run")
    args = parser.parse_args()

    torch.set_num_threads(os.cpu_count() or 1)
    settings = dict(max_model_len=args.prefix_len + args.suffix_len + args.output_len,
                    max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    model = args.model or str(build_default_model())
    vocab_size = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    prefix = [random.Random(args.seed).randrange(5, vocab_size) for _ in range(args.prefix_len)]
    workload = Workload(prefix, args.num_requests, args.suffix_len, vocab_size, args.seed)

    results = {on: bench(model, on, workload, params, args.runs, args.cold, settings) for on in (False, True)}
    print(f"\nmodel {Path(model).name}; {args.num_requests} requests, {args.prefix_len}-token shared prefix + "
          f"{args.suffix_len}-token suffix, {args.output_len} output tokens, greedy, median of {args.runs} runs "
          f"({'cold' if args.cold else 'warm'} prefix cache), {torch.get_num_threads()} threads")
    print(f"{'prefix caching':<16}{'hit rate':>10}{'mean TTFT (ms)':>16}{'output tok/s':>14}")
    for on, (result, hit_rate) in results.items():
        print(f"{'on' if on else 'off':<16}{hit_rate:>10.1%}{result.mean_ttft_s * 1e3:>16.1f}"
              f"{result.output_tokens_per_s:>14.0f}")
    off, on = results[False][0], results[True][0]
    print(f"on / off: TTFT {off.mean_ttft_s / on.mean_ttft_s:.2f}x lower, "
          f"throughput {on.output_tokens_per_s / off.output_tokens_per_s:.2f}x")


if __name__ == "__main__":
    main()
