"""Dual batch overlap (micro-batching): step time at DP=2 with expert parallel, with and without micro-batches.

Two ModelRunner processes (the DP ranks) over gloo, one thread each, run the same steps on a tiny Mixtral (8 experts,
top-2): prefill steps of N tokens (N/16 requests of 16 tokens) and decode steps of N requests. Each step is timed
with micro-batches off and on (enable_dbo, thresholds of 1), interleaved, and the medians are printed as one table.
A micro-batched step runs its two halves on two threads that hand off at each expert all_to_all, so one half's
exchange is in flight while the other computes.

    python scripts/bench_ubatch.py
    python scripts/bench_ubatch.py --sizes 64 256 1024 --repeats 9
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raylm.cluster.engine.config_resolver import resolve_engine_config  # noqa: E402
from raylm.cluster.models.tiny_model import make_tiny_model  # noqa: E402
from raylm.common.outputs import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from raylm.common.sampling_params import SamplingParams  # noqa: E402
from raylm.configs import make_engine_config  # noqa: E402
from raylm.runner.model_runner import ModelRunner  # noqa: E402
from raylm.runner.parallel_state import init_distributed_environment, init_model_parallel  # noqa: E402

MODEL = dict(arch="mixtral", hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8, num_kv_heads=4,
             num_experts=8, num_experts_per_tok=2, vocab_size=2048)
BLOCK_SIZE, PROMPT_LEN = 16, 16
DBO = dict(enable_dbo=True, dbo_decode_token_threshold=1, dbo_prefill_token_threshold=1)


def make_runner(model: str, max_tokens: int, dbo: bool) -> ModelRunner:
    # A decode batch of max_tokens requests starts with their prompts in one step.
    config = resolve_engine_config(make_engine_config(
        model=model, device="cpu", data_parallel_size=2, enable_expert_parallel=True,
        max_num_batched_tokens=max_tokens * PROMPT_LEN, max_num_seqs=max_tokens, max_model_len=256,
        block_size=BLOCK_SIZE, record_forwards=True, **(DBO if dbo else {})))
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(max_tokens * 2 + 8)
    return runner


class Workload:
    """Fresh requests of PROMPT_LEN tokens in blocks 2i, 2i + 1 (the previous ones finished, so blocks are reused),
    then decodes of them."""

    def __init__(self) -> None:
        self.req_ids: list[str] = []
        self.num_computed = 0
        self.serial = 0

    def prefill(self, num_reqs: int) -> SchedulerOutput:
        finished = set(self.req_ids)
        self.serial += 1
        self.req_ids = [f"{self.serial}-{i}" for i in range(num_reqs)]
        new = [NewRequestData(req_id, [5 + (i * 7 + j) % 2000 for j in range(PROMPT_LEN)], [],
                              SamplingParams(temperature=0.0, seed=0), [2 * i, 2 * i + 1], 0)
               for i, req_id in enumerate(self.req_ids)]
        self.num_computed = PROMPT_LEN
        return SchedulerOutput(new, CachedRequestData(), dict.fromkeys(self.req_ids, PROMPT_LEN),
                               PROMPT_LEN * num_reqs, finished)

    def decode(self) -> SchedulerOutput:
        n = len(self.req_ids)
        assert self.num_computed < 2 * BLOCK_SIZE, "each request has two blocks"
        cached = CachedRequestData(list(self.req_ids), [[] for _ in range(n)], [self.num_computed] * n,
                                   [[] for _ in range(n)])
        self.num_computed += 1
        return SchedulerOutput([], cached, dict.fromkeys(self.req_ids, 1), n, set())


def timed(runner: ModelRunner, scheduler_output: SchedulerOutput) -> float:
    start = time.perf_counter()
    runner.execute_model(scheduler_output)
    runner.sample_tokens()
    return time.perf_counter() - start


def _rank(rank: int, store: str, model: str, sizes: list[int], repeats: int, out: str) -> None:
    torch.set_num_threads(1)
    init_distributed_environment(2, rank, f"file://{store}", "gloo")
    init_model_parallel(1, 1, 2, enable_expert_parallel=True)
    max_tokens = max(sizes)
    runners = {dbo: make_runner(model, max_tokens, dbo) for dbo in (False, True)}
    workloads = {dbo: Workload() for dbo in (False, True)}
    rows = []
    for kind in ("prefill", "decode"):
        for size in sizes:
            if kind == "prefill" and size < PROMPT_LEN:
                continue
            times: dict[bool, list[float]] = {False: [], True: []}
            for dbo, runner in runners.items():  # warm-up, and the decode steps' requests
                timed(runner, workloads[dbo].prefill(size // PROMPT_LEN if kind == "prefill" else size))
            for _ in range(repeats):
                for dbo, runner in runners.items():
                    work = workloads[dbo]
                    step = work.prefill(size // PROMPT_LEN) if kind == "prefill" else work.decode()
                    times[dbo].append(timed(runner, step))
            rows.append(dict(kind=kind, tokens=size, eager_ms=1e3 * statistics.median(times[False]),
                             dbo_ms=1e3 * statistics.median(times[True])))
    # Both ranks always have the same batch: every forward with micro-batching on was cut in two.
    dbo_log, eager_log = runners[True].forward_log, runners[False].forward_log
    assert dbo_log is not None and eager_log is not None, "record_forwards counts the forwards"
    assert dbo_log.counts.ubatched == dbo_log.counts.forwards
    assert eager_log.counts.ubatched == 0
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "mixtral", **MODEL)
        mp.start_processes(_rank, args=(str(Path(tmp) / "store"), str(model), args.sizes, args.repeats, tmp),
                           nprocs=2, start_method="spawn")
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(2)]
    print(f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads available, "
          f"DP=2 x EP over gloo, one thread per rank; tiny Mixtral {MODEL['num_layers']} layers, hidden "
          f"{MODEL['hidden_size']}, {MODEL['num_experts']} experts top-2; median of {args.repeats} steps")
    print("| step | tokens per rank | without micro-batches (ms) | with (ms) | with / without |")
    print("|---|---|---|---|---|")
    for row0, row1 in zip(*ranks):
        eager, dbo = max(row0["eager_ms"], row1["eager_ms"]), max(row0["dbo_ms"], row1["dbo_ms"])
        print(f"| {row0['kind']} | {row0['tokens']} | {eager:.1f} | {dbo:.1f} | {dbo / eager:.2f}x |")


if __name__ == "__main__":
    main()
