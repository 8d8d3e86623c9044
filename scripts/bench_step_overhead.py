"""Per-step control-plane cost of the executors: dispatch a SchedulerOutput, collect a ModelRunnerOutput.

The workers' execute_model and sample_tokens are replaced by no-ops (execute_model accepts the SchedulerOutput and
returns None; sample_tokens returns a prebuilt ModelRunnerOutput), so what is timed is the engine's side of a step:
pickling, sending, waking the workers, the reply and its unpickling. For reference it also times the same step as two
plain Ray actor calls (what the control channel replaces).

    python scripts/bench_step_overhead.py [--steps 2000] [--num-decodes 64]
"""
from __future__ import annotations

import argparse
import pickle
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raylm.cluster.engine.config_resolver import resolve_engine_config  # noqa: E402
from raylm.cluster.models.tiny_model import make_tiny_model  # noqa: E402
from raylm.common.outputs import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput  # noqa: E402
from raylm.common.sampling_params import SamplingParams  # noqa: E402
from raylm.configs import make_engine_config  # noqa: E402
from raylm.executor import Executor  # noqa: E402


def make_scheduler_output(num_decodes: int, num_new: int, prompt_len: int) -> SchedulerOutput:
    """A busy decode step: `num_decodes` running requests (one token each, a new block now and then) and `num_new`
    requests arriving with their prompts."""
    cached = CachedRequestData()
    for i in range(num_decodes):
        cached.req_ids.append(f"cmpl-{i:08x}")
        cached.new_block_ids.append([1000 + i] if i % 16 == 0 else [])
        cached.num_computed_tokens.append(300 + i)
        cached.new_token_ids.append([])
    new = [NewRequestData(f"cmpl-new-{i}", [(7919 * (i + 1) * j) % 150_000 for j in range(prompt_len)], [],
                          SamplingParams(temperature=0.7, seed=i), list(range(prompt_len // 16 + 1)), 0)
           for i in range(num_new)]  # token ids spread like a large vocabulary's
    scheduled = {req_id: 1 for req_id in cached.req_ids} | {r.req_id: prompt_len for r in new}
    return SchedulerOutput(new, cached, scheduled, sum(scheduled.values()), set())


def make_runner_output(scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
    req_ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids, [[7] for _ in req_ids])


def install_noop_steps(worker: Any, runner_output: ModelRunnerOutput) -> None:
    worker.execute_model = lambda scheduler_output: None
    worker.sample_tokens = lambda: runner_output


def time_executor(executor: Executor, scheduler_output: SchedulerOutput, steps: int) -> np.ndarray:
    executor.collective_rpc(install_noop_steps, (make_runner_output(scheduler_output),))
    times = np.empty(steps)
    for i in range(steps):
        start = time.perf_counter()
        execute_future = executor.execute_model(scheduler_output)
        output = executor.sample_tokens().result() or execute_future.result()
        times[i] = time.perf_counter() - start
        assert output is not None and len(output.req_ids) == len(scheduler_output.num_scheduled_tokens)
    return times


@ray.remote(num_cpus=0)
class PlainActor:
    def __init__(self, runner_output: ModelRunnerOutput) -> None:
        self.runner_output = runner_output

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        return None

    def sample_tokens(self) -> ModelRunnerOutput:
        return self.runner_output


def time_plain_ray(num_workers: int, scheduler_output: SchedulerOutput, steps: int) -> np.ndarray:
    actors = [PlainActor.remote(make_runner_output(scheduler_output)) for _ in range(num_workers)]
    times = np.empty(steps)
    for i in range(steps):
        start = time.perf_counter()
        ref = ray.put(scheduler_output)  # serialized once, shared by every actor
        ray.get([actor.execute_model.remote(ref) for actor in actors])
        ray.get([actor.sample_tokens.remote() for actor in actors])[0]
        times[i] = time.perf_counter() - start
    for actor in actors:
        ray.kill(actor)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--num-decodes", type=int, default=64)
    parser.add_argument("--num-new", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=256)
    args = parser.parse_args()

    scheduler_output = make_scheduler_output(args.num_decodes, args.num_new, args.prompt_len)
    print(f"SchedulerOutput: {args.num_decodes} decodes + {args.num_new} new x {args.prompt_len} prompt tokens = "
          f"{len(pickle.dumps(scheduler_output, protocol=5))} bytes pickled; {args.steps} steps per case\n")
    model = make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", num_layers=2, vocab_size=512)
    ray.init(address="local", num_cpus=8, include_dashboard=False)
    warmup = min(200, args.steps)
    rows = []
    for backend, tp, async_scheduling in [("uni", 1, False), ("uni", 1, True), ("ray", 1, False), ("ray", 2, False)]:
        config = resolve_engine_config(make_engine_config(
            model=str(model), device="cpu", tensor_parallel_size=tp, distributed_executor_backend=backend,
            async_scheduling=async_scheduling))
        executor = Executor.get_class(config)(config)
        try:
            times = time_executor(executor, scheduler_output, args.steps + warmup)[warmup:]
        finally:
            executor.shutdown()
        thread = " (step thread)" if backend == "uni" and async_scheduling else ""
        rows.append((f"{type(executor).__name__} TP={tp}{thread}", times))
    for tp in (1, 2):
        times = time_plain_ray(tp, scheduler_output, args.steps + warmup)[warmup:]
        rows.append((f"plain Ray actor calls TP={tp}", times))
    ray.shutdown()

    print(f"{'case':<36} {'median (ms)':>12} {'p90 (ms)':>10}")
    for name, times in rows:
        print(f"{name:<36} {np.median(times) * 1e3:>12.3f} {np.percentile(times, 90) * 1e3:>10.3f}")


if __name__ == "__main__":
    main()
