"""What a prompt costs the streams decoding beside it, per `max_prefill_tokens_with_decodes` (docs/scheduling.md).

Timed: one engine on a checkpoint (at --dtype, its default `auto` or float32), 8 requests decoding, then a 256-token
prompt joins them; every step until the prompt has its first token is timed, for each chunk size in turn (the
scheduler's cap changed between runs, the order reversed every other round), beside the decode steps alone. Printed:
the longest step against a decode step, and the prompt's steps in all, medians over the rounds.

--simulate runs the real Scheduler with a stand-in runner instead (no model, no timing): 8 closed-loop clients, 64
requests of 256/257 prompt and 128 output tokens; printed per chunk size: the steps that carried decodes and prompt
tokens together, and the largest of them.

    python scripts/bench_prefill_chunk.py --model models/smollm2-135m-f32 --dtype float32 --threads 1 --rounds 3
    python scripts/bench_prefill_chunk.py --model SmolLM2-135M-Instruct.Q4_1.gguf --threads 2 --chunks 0 16 32 64
    python scripts/bench_prefill_chunk.py --simulate
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raylm.cluster import LLM, SamplingParams  # noqa: E402
from scripts.bench_common import matmul_gflops  # noqa: E402

CHUNKS = [0, 32, 64, 128]


def time_steps(model: str, rounds: int, dtype: str, chunks: list[int]) -> None:
    llm = LLM(model=model, dtype=dtype, max_model_len=1024, enable_prefix_caching=False,
              max_prefill_tokens_with_decodes=0, disable_log_stats=True)
    engine = llm.llm_engine
    scheduler = engine.engine_core.scheduler
    count = 0

    def add(length: int, max_tokens: int) -> None:
        nonlocal count
        count += 1
        engine.add_request(f"r{count}", {"prompt_token_ids": [100 + (count * 7 + i) % 4000 for i in range(length)]},
                           SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens))

    def timed(steps: int) -> list[float]:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        return times

    for _ in range(8):
        add(16, max_tokens=100_000 // 8)
    timed(6)  # all 8 decode from here on
    decode: list[float] = []
    runs: dict[int, list[tuple[float, float, int]]] = {}
    for round_index in range(rounds):
        for chunk in chunks if round_index % 2 == 0 else chunks[::-1]:
            scheduler.max_prefill_tokens_with_decodes = chunk
            decode += timed(3)
            add(256, max_tokens=1)  # leaves with its first token: 8 decodes again after
            steps = timed(1)
            while len(scheduler.running) > 8 or scheduler.waiting:
                steps += timed(1)
            runs.setdefault(chunk, []).append((max(steps), sum(steps), len(steps)))
        print(f"  round {round_index + 1} done", file=sys.stderr, flush=True)
    step = statistics.median(decode)
    print(f"8 decodes alone: {step * 1e3:.0f} ms a step (median of {len(decode)})")
    print("| prompt tokens beside decodes | longest step | vs a decode step | the prompt's steps in all |\n"
          "|---|---|---|---|")
    for chunk, values in runs.items():
        longest, total = statistics.median(v[0] for v in values), statistics.median(v[1] for v in values)
        print(f"| {chunk or 'off'} | {longest * 1e3:,.0f} ms | {longest / step:.1f}x | {total * 1e3:,.0f} ms "
              f"({values[0][2]} steps) |")


def simulate() -> None:
    from raylm.cluster.core.scheduler import Scheduler
    from raylm.configs.engine_config import CacheConfig, SchedulerConfig
    from tests.test_scheduler import BLOCK_SIZE, FakeRunner, make_request

    for chunk in CHUNKS:
        config = SchedulerConfig(max_num_batched_tokens=2048, max_prefill_tokens_with_decodes=chunk)
        scheduler = Scheduler(config, CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False), 512, 20_000,
                              BLOCK_SIZE)
        runner, sent = FakeRunner(sample=lambda req_id, position: 5), 0
        for sent in range(1, 9):  # every fifth prompt one token longer, as the served load's words tokenize
            scheduler.add_request(make_request(f"r{sent}", 256 + (sent % 5 == 0), max_tokens=128, ignore_eos=True))
        steps, mixed, largest = 0, 0, 0
        while scheduler.has_unfinished_requests():
            out = scheduler.schedule()
            num_decodes = sum(1 for n in out.num_scheduled_tokens.values() if n == 1)
            if num_decodes and out.total_num_scheduled_tokens > num_decodes:
                mixed += 1
                largest = max(largest, out.total_num_scheduled_tokens)
            steps += 1
            for output in scheduler.update_from_output(out, runner.execute(out)):
                if output.finish_reason is not None and sent < 64:
                    sent += 1
                    scheduler.add_request(make_request(f"r{sent}", 256 + (sent % 5 == 0), max_tokens=128,
                                                       ignore_eos=True))
        print(f"chunk {chunk or 'off'}: {steps} steps, {mixed} with decodes and prompt tokens together, the largest "
              f"{largest} tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a checkpoint folder or GGUF file")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--chunks", type=int, nargs="+", default=CHUNKS, help="caps timed (0: off)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--simulate", action="store_true", help="the scheduler alone, no model")
    args = parser.parse_args()
    if args.simulate:
        simulate()
        return
    if not args.model:
        parser.error("--model is needed (or --simulate)")
    torch.set_num_threads(args.threads)
    print(f"before: fp32 2048^3 matmul {matmul_gflops():.0f} GFLOP/s ({args.threads} thread(s))", flush=True)
    time_steps(args.model, args.rounds, args.dtype, args.chunks)
    print(f"after:  fp32 2048^3 matmul {matmul_gflops():.0f} GFLOP/s")


if __name__ == "__main__":
    main()
