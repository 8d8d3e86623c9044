"""Part (c) of scripts/bench_cluster.py: long prompts arriving among running decodes, colocated vs disaggregated.

Each engine runs in a Ray actor of its own and is stepped there, timestamping every output token. Colocated: one
engine with all the machine's cores takes the decodes and the long prompts. Disaggregated: a prefill engine
(kv_producer) takes the long prompts and hands their KV to a decode engine (kv_consumer) that runs the decodes, each
engine with half the cores; the decode engine learns of each prefilled prompt through a Ray queue and adds it with its
kv_transfer_params. Reported: the decodes' inter-token latency p50/p99, and the long prompts' TTFT.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import ray
import torch
from ray.util.queue import Queue

from raylm.cluster import LLM, SamplingParams

_PREFILL = SamplingParams(temperature=0.0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})


@ray.remote(num_cpus=0)
class EngineProcess:
    def __init__(self, settings: dict[str, Any], threads: int) -> None:
        torch.set_num_threads(threads)
        self.llm = LLM(**settings)

    def warm_up(self, prompts: list[list[int]]) -> None:
        self.llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=4), use_tqdm=False)

    def serve(self, start_at: float, decodes: list[list[int]], decode_len: int, long: list[list[int]],
              arrivals: list[float], long_len: int, queue: Queue | None) -> dict[str, list[float]]:
        """The decodes from start_at, and the long prompts at their arrival times (or, with a queue, once their
        prefill arrives through it); returns the decodes' inter-token gaps and the long prompts' TTFTs."""
        engine = self.llm.llm_engine
        decode_params = SamplingParams(temperature=0.0, max_tokens=decode_len, ignore_eos=True)
        long_params = SamplingParams(temperature=0.0, max_tokens=long_len, ignore_eos=True)
        while time.time() < start_at:
            time.sleep(0.001)
        for i, prompt in enumerate(decodes):
            engine.add_request(f"d{i}", {"prompt_token_ids": prompt}, decode_params, output_kind="delta")
        last: dict[str, float] = {}
        gaps, ttfts, pending = [], [], list(range(len(long)))
        polled = 0.0  # the queue is an actor: asked every 10 ms, not every step
        while pending or engine.has_unfinished_requests():
            now = time.time()
            if queue is None:
                while pending and start_at + arrivals[pending[0]] <= now:
                    i = pending.pop(0)
                    engine.add_request(f"l{i}", {"prompt_token_ids": long[i]}, long_params, output_kind="delta")
            elif pending and now - polled > 0.01:
                polled = now
                for i, params in queue.get_nowait_batch(queue.qsize()) if not queue.empty() else []:
                    pending.remove(i)
                    with_kv = SamplingParams(temperature=0.0, max_tokens=long_len, ignore_eos=True,
                                             extra_args={"kv_transfer_params": params})
                    engine.add_request(f"l{i}", {"prompt_token_ids": long[i]}, with_kv, output_kind="delta")
            if not engine.has_unfinished_requests():
                time.sleep(0.001)
                continue
            for output in engine.step():
                now = time.time()
                if output.request_id.startswith("d") and output.outputs[0].token_ids:
                    if output.request_id in last:
                        gaps.append(now - last[output.request_id])
                    last[output.request_id] = now
                elif output.request_id.startswith("l") and output.request_id not in last:
                    last[output.request_id] = now
                    ttfts.append(now - start_at - arrivals[int(output.request_id[1:])])
        return {"gaps": gaps, "ttfts": ttfts}

    def prefill(self, start_at: float, long: list[list[int]], arrivals: list[float], queue: Queue) -> None:
        """Each long prompt at its arrival time, for one token; its kv_transfer_params into the queue when done."""
        engine = self.llm.llm_engine
        pending = list(range(len(long)))
        while pending or engine.has_unfinished_requests():
            while pending and start_at + arrivals[pending[0]] <= time.time():
                i = pending.pop(0)
                engine.add_request(f"p{i}", {"prompt_token_ids": long[i]}, _PREFILL, output_kind="final")
            if not engine.has_unfinished_requests():
                time.sleep(0.001)
                continue
            for output in engine.step():
                if output.finished:
                    queue.put((int(output.request_id[1:]), output.kv_transfer_params))

    def shutdown(self) -> None:
        self.llm.shutdown()


def _workload(args: argparse.Namespace, seed: int) -> tuple[list[list[int]], list[list[int]], list[float]]:
    rng = random.Random(seed)
    decodes = [[rng.randrange(5, args.vocab) for _ in range(32)] for _ in range(args.num_decodes)]
    long = [[rng.randrange(5, args.vocab) for _ in range(args.long_len)] for _ in range(args.num_long)]
    return decodes, long, [0.3 + 0.25 * i for i in range(args.num_long)]


def run_disaggregation(model: Path, args: argparse.Namespace) -> list[str]:
    cores = os.cpu_count() or 1
    common = dict(model=str(model), max_model_len=args.long_len + 64, max_num_seqs=32, max_num_batched_tokens=512)
    half = max(1, cores // 2)
    colocated = {f"colocated, {cores} cores": EngineProcess.remote(common, cores),
                 f"colocated, {half} core(s)": EngineProcess.remote(common, half)}
    prefill = EngineProcess.remote(common | {"kv_connector": "RayKVConnector", "kv_role": "kv_producer"}, half)
    decode = EngineProcess.remote(common | {"kv_connector": "RayKVConnector", "kv_role": "kv_consumer"}, half)
    disaggregated = f"disaggregated, prefill + decode engines of {half} core(s) each"
    actors = [*colocated.values(), prefill, decode]
    results: dict[str, list[dict[str, list[float]]]] = {name: [] for name in [*colocated, disaggregated]}
    for run in range(args.runs + 1):
        decodes, long, arrivals = _workload(args, seed=2000 + run)
        if run == 0:
            ray.get([actor.warm_up.remote(decodes[:2] + long[:1]) for actor in actors])
        for name, actor in colocated.items():
            start_at = time.time() + 0.5
            result = ray.get(actor.serve.remote(start_at, decodes, args.decode_len, long, arrivals, 4, None))
            if run:
                results[name].append(result)
        queue = Queue()
        start_at = time.time() + 0.5
        done = prefill.prefill.remote(start_at, long, arrivals, queue)
        result = ray.get(decode.serve.remote(start_at, decodes, args.decode_len, long, arrivals, 4, queue))
        ray.get(done)
        queue.shutdown()
        if run:
            results[disaggregated].append(result)
    ray.get([actor.shutdown.remote() for actor in actors])
    lines = [f"(c) {args.num_decodes} decodes of {args.decode_len} tokens running while {args.num_long} prompts of "
             f"{args.long_len} tokens arrive 0.25 s apart ({args.pd_model} model, max_num_batched_tokens 512), each "
             f"engine in a process of its own",
             "| layout | decode ITL p50 (ms) | decode ITL p99 (ms) | long-prompt TTFT p50 (ms) |", "|---|---|---|---|"]
    for name, runs in results.items():
        gaps = [g for r in runs for g in r["gaps"]]
        ttfts = [t for r in runs for t in r["ttfts"]]
        lines.append(f"| {name} | {_pct(gaps, 50) * 1e3:.1f} | {_pct(gaps, 99) * 1e3:.1f} | "
                     f"{statistics.median(ttfts) * 1e3:.0f} |")
    return lines


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]
