"""Structured output against the same requests unconstrained, side by side in one run, on the 5M Llama: a batch of 64
requests with 64 different JSON schemas (throughput, target >= 0.9x unconstrained), grammar compile time p50 / p99
over the schemas, and the per-step cost of the bitmask (filled by the engine while the forward runs) and of applying
it to the logits (in sample_tokens).

    python scripts/bench_structured.py [--runs 5] [--backend xgrammar]

Each constrained request writes strings that never close within max_tokens (greedy on random weights), so both sides
generate the same 64 x 64 tokens. Runs alternate (unconstrained, constrained, ...); the first constrained run also
compiles the 64 grammars and is reported apart.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import raylm.runner.model_runner as model_runner_module
from raylm.cluster import LLM, SamplingParams
from raylm.cluster.structured_output.backend_guidance import GuidanceBackend
from raylm.cluster.structured_output.backend_xgrammar import XgrammarBackend
from raylm.common.structured_outputs import StructuredOutputsParams
from scripts.bench_common import machine_line, make_workload, preset_model, vocab_size  # noqa: E402

NUM_REQUESTS = 64
OUTPUT_LEN = 64


def make_schemas(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """Distinct schemas in the shapes of API payloads: named fields of every kind, nested objects, arrays, enums."""
    rng = random.Random(seed)
    kinds: list[Callable[[int], dict[str, Any]]] = [
        lambda i: {"type": "string"},
        lambda i: {"type": "integer", "minimum": -i, "maximum": 1000 + i},
        lambda i: {"enum": [f"v{i}_{k}" for k in range(3)]},
        lambda i: {"type": "array", "items": {"type": "string"}},
        lambda i: {"type": "object", "properties": {f"inner_{i}": {"type": "string"}, "flag": {"type": "boolean"}},
                   "required": [f"inner_{i}", "flag"]},
        lambda i: {"type": "number"},
    ]
    schemas = []
    for i in range(count):
        names = [f"field_{i}_{k}" for k in range(rng.randint(2, 5))]
        # A free string first: the output never gets past it in OUTPUT_LEN tokens, as long as the unconstrained run.
        properties = {names[0]: {"type": "string"}} | {name: rng.choice(kinds)(i) for name in names[1:]}
        schemas.append({"title": f"Record{i}", "type": "object", "properties": properties, "required": names,
                        "additionalProperties": False})
    return schemas


def compile_times(model: str, schemas: list[dict[str, Any]], backend: str) -> list[float]:
    """Seconds to compile each schema against the tokenizer, from a fresh compiler (no cache)."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    vocab = vocab_size(preset_model("5m"))
    engine = XgrammarBackend(tokenizer, vocab, [tokenizer.eos_token_id]) if backend == "xgrammar" else \
        GuidanceBackend(tokenizer, vocab)
    times = []
    for schema in schemas:
        if backend == "xgrammar":
            engine.compiler.clear_cache()  # type: ignore[union-attr]
        start = time.perf_counter()
        engine.compile(StructuredOutputsParams(json=schema)).new_grammar()
        times.append(time.perf_counter() - start)
    return times


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Timer:
    """Wraps a function, keeping the seconds of each call."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn, self.times = fn, []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.times.append(time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--backend", choices=["xgrammar", "guidance"], default="xgrammar")
    args = parser.parse_args()

    print(machine_line())
    model = preset_model("5m")
    schemas = make_schemas(NUM_REQUESTS)
    prompts, _ = make_workload(NUM_REQUESTS, (16, 64), (OUTPUT_LEN, OUTPUT_LEN), vocab_size(model), seed=0)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm = LLM(model=str(model), max_num_seqs=NUM_REQUESTS, enable_prefix_caching=False,
              structured_outputs_backend=args.backend)
    free = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    constrained = [SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True,
                                  structured_outputs=StructuredOutputsParams(json=schema)) for schema in schemas]
    manager = llm.llm_engine.engine_core.structured_output_manager  # type: ignore[union-attr]
    fill = manager.grammar_bitmask = Timer(manager.grammar_bitmask)
    apply = model_runner_module.apply_grammar_bitmask = Timer(model_runner_module.apply_grammar_bitmask)

    def run(params: SamplingParams | list[SamplingParams]) -> tuple[float, int]:
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outputs)

    run(free)  # warm-up
    cold, cold_tokens = run(constrained)  # compiles the 64 grammars
    fill.times.clear()
    apply.times.clear()
    times: dict[str, list[float]] = {"unconstrained": [], "json schema": []}
    tokens: dict[str, int] = {}
    for _ in range(args.runs):
        for name, params in (("unconstrained", free), ("json schema", constrained)):
            seconds, count = run(params)
            times[name].append(seconds)
            tokens[name] = count
    llm.shutdown()
    assert tokens["unconstrained"] == tokens["json schema"] == cold_tokens == NUM_REQUESTS * OUTPUT_LEN

    print(f"{NUM_REQUESTS} requests x {OUTPUT_LEN} tokens, 5M Llama, backend {args.backend}, {args.runs} runs each")
    print("| workload | median (s) | spread | output tok/s | vs unconstrained |")
    print("|---|---|---|---|---|")
    base = statistics.median(times["unconstrained"])
    for name, values in times.items():
        median = statistics.median(values)
        spread = (max(values) - min(values)) / median
        print(f"| {name} | {median:.2f} | {spread:.0%} | {tokens[name] / median:,.0f} | {base / median:.2f}x |")
    print(f"| json schema, first run (compiles 64 grammars) | {cold:.2f} | | {cold_tokens / cold:,.0f} | "
          f"{base / cold:.2f}x |")
    per_step_fill = [t * 1e3 for t in fill.times]
    per_step_apply = [t * 1e3 for t in apply.times]
    print(f"per step: bitmask fill (engine, {NUM_REQUESTS} rows) median {statistics.median(per_step_fill):.2f} ms, "
          f"p99 {percentile(per_step_fill, 0.99):.2f} ms; apply to logits (runner) median "
          f"{statistics.median(per_step_apply):.2f} ms, p99 {percentile(per_step_apply, 0.99):.2f} ms; "
          f"{len(per_step_fill)} steps")
    for backend in ("xgrammar", "guidance"):
        compiled = [t * 1e3 for t in compile_times(str(model), schemas, backend)]
        print(f"compile ({backend}, {len(compiled)} schemas): p50 {percentile(compiled, 0.5):.1f} ms, "
              f"p99 {percentile(compiled, 0.99):.1f} ms")
    print(machine_line())
    print(json.dumps({name: values for name, values in times.items()}))


if __name__ == "__main__":
    main()
