"""Where a step's time goes: the share of each phase, at the three model shapes, prefill-heavy and decode-heavy.

The engine runs in this process (one worker, in-process executor) with the step timeline on (runner/tracing.py):
schedule, update_states, prepare_inputs, forward, compute_logits, sample, update_from_output (the scheduler's side)
and process_outputs (output processing, with detokenize measured apart). The forward is split by layer type in a
second, identical run with timing hooks on the model's leaf modules; what the leaves do not cover is the forward's
own Python (the decoder-layer loop, splits and residual adds). The two kinds of run alternate; the hooked forward's
split (its hooks' own cost, measured on an identity module, taken out) is applied to the plain runs' forward time.

    python scripts/profile_step.py                       # tiny, 5m and 100m, prefill- and decode-heavy
    python scripts/profile_step.py --shapes tiny 5m --num-requests 32
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raylm.cluster import LLM, SamplingParams  # noqa: E402
from raylm.cluster.detokenizer import IncrementalDetokenizer  # noqa: E402
from raylm.common import tracing  # noqa: E402
from scripts.bench_common import (  # noqa: E402
    PRESETS,
    decoder_linear_weights,
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
    """Forward hooks on the leaf modules, adding each call's seconds to its layer type."""
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
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


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


def profile(preset: str, workload: str, num_requests: int, runs: int) -> tuple[dict[str, float], float, int, float]:
    """Seconds per phase of one run (mean of `runs`), the wall seconds of one run, its output tokens and the FLOPs of
    its decoder linears (every token but each request's last is computed)."""
    model_path = preset_model(preset)
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
    linear_flops = 2.0 * decoder_linear_weights(model_path) * computed_tokens
    return {name: seconds / runs for name, seconds in totals.items()}, wall / runs, sum(output_lens), linear_flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=PRESETS, default=list(PRESETS))
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    print(machine_line())

    columns: list[tuple[str, dict[str, float], float, int, float]] = []
    for preset in args.shapes:
        for workload in args.workloads:
            columns.append((f"{preset} {workload}", *profile(preset, workload, args.num_requests, args.runs)))
            wall = columns[-1][2]
            print(f"  {preset} {workload}: {wall:.2f} s per run", file=sys.stderr)

    rows = [p for p in PHASES if p != "forward"]
    rows[rows.index("compute_logits"):rows.index("compute_logits")] = [f"forward: {k}" for k in
                                                                      dict.fromkeys(LAYER_TYPES.values())]
    rows[rows.index("compute_logits"):rows.index("compute_logits")] = ["forward: other"]
    rows += ["detokenize", "engine loop (rest)"]
    header = f"| phase (% of the run) | {' | '.join(name for name, *_ in columns)} |"
    print("\n" + header + "\n" + "|---" * (len(columns) + 1) + "|")
    for row in rows:
        cells = [f"{shares.get(row, 0.0) / wall * 100:.1f}" for _, shares, wall, _, _ in columns]
        print(f"| {row} | {' | '.join(cells)} |")
    print(f"| **run time (s)** | {' | '.join(f'{wall:.2f}' for _, _, wall, _, _ in columns)} |")
    print(f"| **output tok/s** | {' | '.join(f'{tokens / wall:.0f}' for _, _, wall, tokens, _ in columns)} |")
    rates = [flops / sum(shares[f"forward: {name}"] for name in LINEARS) / 1e9 for _, shares, _, _, flops in columns]
    print(f"| **decoder linears (GFLOP/s)** | {' | '.join(f'{rate:.0f}' for rate in rates)} |")
    print(f"\n{args.num_requests} requests per run, prefill: input {WORKLOADS['prefill'][0]} output "
          f"{WORKLOADS['prefill'][1]}; decode: input {WORKLOADS['decode'][0]} output {WORKLOADS['decode'][1]}; "
          f"greedy fp32, mean of {args.runs} runs after a warm-up, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
