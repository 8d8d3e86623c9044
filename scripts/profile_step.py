"""Where a step's time goes: the share of each phase, at the three model shapes, prefill-heavy and decode-heavy.

The engine runs in this process (one worker, in-process executor) with the step timeline on (runner/tracing.py):
schedule, update_states, prepare_inputs, forward, compute_logits, sample, update_from_output (the scheduler's side)
and process_outputs (output processing, with detokenize measured apart). The forward is split by layer type in a
second, identical run with timing hooks on the model's leaf modules; what the leaves do not cover is the forward's
own Python (the decoder-layer loop, splits and residual adds). The two kinds of run alternate; the hooked forward's
split (its hooks' own cost, measured on an identity module, taken out) is applied to the plain runs' forward time.
The hooked runs take the module-by-module path (the CPU layer stack runs the layers in one call, where no hook
fires), so with the stack on, "forward: other" is the module path's share, more than the plain runs spend.

    python scripts/profile_step.py                       # tiny, 5m and 100m, prefill- and decode-heavy
    python scripts/profile_step.py --shapes tiny 5m --num-requests 32
    python scripts/profile_step.py --model path/to/smollm2-f32 --shapes   # a real checkpoint alone

Below the phase table, each decoder linear's rate (GFLOP/s over its (in x out) shape) stands beside the machine's
fp32 matmul rate, so a reader sees which shape the kernels plan badly.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raylm.cluster import LLM, SamplingParams  # noqa: E402
from raylm.cluster.engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from raylm.common import tracing  # noqa: E402
from scripts.bench_common import (  # noqa: E402
    PRESETS,
    machine_line,
    make_workload,
    preset_model,
    vocab_size,
)

# (input length range, output length range): prefill-heavy is mostly prompt tokens, decode-heavy mostly output.
WORKLOADS = {"prefill": ((128, 256), (1, 4)), "decode": ((8, 16), (96, 128))}
# Timeline spans that do not overlap; the engine's execute_model / sample_tokens spans hold them.
PHASES = ["schedule", "update_states", "prepare_inputs", "batch_decision", "forward", "compute_logits", "sample",
          "update_from_output", "process_outputs"]
LINEARS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
# Leaf modules by attribute name -> the row of the table.
LAYER_TYPES = {"embed_tokens": "embedding", "input_layernorm": "rms_norm", "post_attention_layernorm": "rms_norm",
               "norm": "rms_norm", "qkv_proj": "qkv_proj", "rotary_emb": "rotary", "attn": "attention",
               "o_proj": "o_proj", "gate_up_proj": "gate_up_proj", "act_fn": "silu_and_mul",
               "down_proj": "down_proj"}


def run_workload(llm: LLM, prompts: list[list[int]], output_lens: list[int]) -> float:
    inputs = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in output_lens]
    start = time.perf_counter()
    llm.generate(inputs, params, use_tqdm=False)
    return time.perf_counter() - start


def span_seconds() -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for event in tracing.drain():
        if event.get("ph") == "X":
            totals[event["name"]] += event["dur"] / 1e6
    return totals


@contextmanager
def timed_detokenize(totals: dict[str, float]) -> Iterator[None]:
    """IncrementalDetokenizer.update, timed: the detokenize part of process_outputs."""
    original = IncrementalDetokenizer.update

    def update(self: IncrementalDetokenizer, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(self, *args)
        finally:
            totals["detokenize"] += time.perf_counter() - start

    IncrementalDetokenizer.update = update  # type: ignore[method-assign]
    try:
        yield
    finally:
        IncrementalDetokenizer.update = original  # type: ignore[method-assign]


@contextmanager
def timed_layers(model: torch.nn.Module, totals: dict[str, float]) -> Iterator[None]:
    """Forward hooks on the leaf modules, adding each call's seconds to its layer type. Hooks need the module path:
    the CPU layer stack (one kernel call for all layers) is off meanwhile, so the split is the module path's."""
    starts: dict[int, float] = {}

    def make_hooks(kind: str) -> tuple[Callable[..., None], Callable[..., None]]:
        def pre(module: torch.nn.Module, args: Any) -> None:
            starts[id(module)] = time.perf_counter()

        def post(module: torch.nn.Module, args: Any, output: Any) -> None:
            totals[kind] += time.perf_counter() - starts.pop(id(module))
            totals["calls"] += 1

        return pre, post

    handles = []
    for name, module in model.named_modules():
        kind = LAYER_TYPES.get(name.rsplit(".", 1)[-1])
        if kind is not None and not name.startswith("lm_head"):
            pre, post = make_hooks(kind)
            handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    inner = getattr(model, "model", None)
    stack = getattr(inner, "layer_stack", None)
    if stack is not None:
        inner.layer_stack = None
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        if stack is not None:
            inner.layer_stack = stack


def hook_overhead_seconds(calls: int = 20_000) -> float:
    """What a pre- and post-hook pair adds to one module call, measured on an identity module."""
    module, x = torch.nn.Identity(), torch.zeros(1)
    totals: dict[str, float] = defaultdict(float)

    def time_calls() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            module(x)
        return time.perf_counter() - start

    plain = time_calls()
    with timed_layers(torch.nn.ModuleDict({"attn": module}), totals):
        hooked = time_calls()
    return max(0.0, hooked - plain) / calls


def linear_shapes(model: torch.nn.Module) -> dict[str, tuple[int, int, int]]:
    """(in features, out features, number of layers) of each decoder linear kind, read from the loaded weights."""
    shapes: dict[str, tuple[int, int, int]] = {}
    for name, module in model.named_modules():
        kind = name.rsplit(".", 1)[-1]
        if kind in LINEARS:
            out_features, in_features = module.gemm_shape()  # a quantized weight's logical shape, not its bytes
            shapes[kind] = (in_features, out_features, shapes.get(kind, (0, 0, 0))[2] + 1)
    return shapes


@dataclass
class Profile:
    """One model and workload: seconds per phase of one run (mean of the runs), the run's wall seconds and output
    tokens, and each decoder linear kind's (in, out, layers) and FLOPs (every token but each request's last)."""

    shares: dict[str, float]
    wall: float
    output_tokens: int
    linear_shapes: dict[str, tuple[int, int, int]]
    linear_flops: dict[str, float]


def profile(model_path: Path, workload: str, num_requests: int, runs: int) -> Profile:
    input_len, output_len = WORKLOADS[workload]
    prompts, output_lens = make_workload(num_requests, input_len, output_len, vocab_size(model_path), seed=0)
    llm = LLM(model=str(model_path), max_model_len=input_len[1] + output_len[1], max_num_seqs=64,
              max_num_batched_tokens=2048, enable_prefix_caching=False)
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    run_workload(llm, prompts, output_lens)  # warm-up
    tracing.enable("profile", pid=0)
    totals: dict[str, float] = defaultdict(float)
    layers: dict[str, float] = defaultdict(float)
    wall = hooked_forward = 0.0
    try:
        # Plain and hooked runs alternate, so that the machine's noise falls on both alike.
        for _ in range(runs):
            with timed_detokenize(totals):
                wall += run_workload(llm, prompts, output_lens)
            for name, seconds in span_seconds().items():
                if name in PHASES:
                    totals[name] += seconds
            with timed_layers(model, layers):
                run_workload(llm, prompts, output_lens)
            hooked_forward += span_seconds()["forward"]
    finally:
        tracing.disable()
        llm.shutdown()
    totals["process_outputs"] -= totals["detokenize"]
    # The hooked forward split into leaves and the rest (its hooks' own cost taken out), scaled to the plain forward.
    hook_cost = layers.pop("calls") * hook_overhead_seconds()
    hooked_rest = max(0.0, hooked_forward - sum(layers.values()) - hook_cost)
    scale = totals.pop("forward") / (sum(layers.values()) + hooked_rest)
    for kind, seconds in layers.items():
        totals[f"forward: {kind}"] = seconds * scale
    totals["forward: other"] = hooked_rest * scale
    totals["engine loop (rest)"] = max(0.0, wall - sum(totals.values()))
    computed_tokens = sum(len(p) + n - 1 for p, n in zip(prompts, output_lens))
    shapes = linear_shapes(model)
    return Profile(shares={name: seconds / runs for name, seconds in totals.items()}, wall=wall / runs,
                   output_tokens=sum(output_lens), linear_shapes=shapes,
                   linear_flops={kind: 2.0 * fan_in * fan_out * count * computed_tokens
                                 for kind, (fan_in, fan_out, count) in shapes.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", choices=PRESETS, default=list(PRESETS),
                        help="synthetic presets to profile (none: only --model)")
    parser.add_argument("--model", help="a checkpoint folder profiled beside the presets (e.g. the real model)")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    print(machine_line())

    models = {preset: preset_model(preset) for preset in args.shapes}
    if args.model:
        models[Path(args.model).name] = Path(args.model)
    columns: dict[str, Profile] = {}
    for label, model_path in models.items():
        for workload in args.workloads:
            columns[f"{label} {workload}"] = run = profile(model_path, workload, args.num_requests, args.runs)
            print(f"  {label} {workload}: {run.wall:.2f} s per run", file=sys.stderr)

    rows = [p for p in PHASES if p != "forward"]
    rows[rows.index("compute_logits"):rows.index("compute_logits")] = [f"forward: {k}" for k in
                                                                      dict.fromkeys(LAYER_TYPES.values())]
    rows[rows.index("compute_logits"):rows.index("compute_logits")] = ["forward: other"]
    rows += ["detokenize", "engine loop (rest)"]
    header = f"| phase (% of the run) | {' | '.join(columns)} |"
    print("\n" + header + "\n" + "|---" * (len(columns) + 1) + "|")
    for row in rows:
        cells = [f"{run.shares.get(row, 0.0) / run.wall * 100:.1f}" for run in columns.values()]
        print(f"| {row} | {' | '.join(cells)} |")
    print(f"| **run time (s)** | {' | '.join(f'{run.wall:.2f}' for run in columns.values())} |")
    print(f"| **output tok/s** | {' | '.join(f'{run.output_tokens / run.wall:.0f}' for run in columns.values())} |")
    rates = [sum(run.linear_flops.values()) / sum(run.shares[f"forward: {kind}"] for kind in LINEARS) / 1e9
             for run in columns.values()]
    print(f"| **decoder linears (GFLOP/s)** | {' | '.join(f'{rate:.0f}' for rate in rates)} |")
    for kind in LINEARS:
        cells = [f"{run.linear_flops[kind] / run.shares[f'forward: {kind}'] / 1e9:.0f} "
                 f"({run.linear_shapes[kind][0]}x{run.linear_shapes[kind][1]})" for run in columns.values()]
        print(f"| {kind} GFLOP/s (in x out) | {' | '.join(cells)} |")
    print(f"\n{args.num_requests} requests per run, prefill: input {WORKLOADS['prefill'][0]} output "
          f"{WORKLOADS['prefill'][1]}; decode: input {WORKLOADS['decode'][0]} output {WORKLOADS['decode'][1]}; "
          f"greedy at each model's default dtype, mean of {args.runs} runs after a warm-up, "
          f"{torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
