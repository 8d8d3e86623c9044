"""Speed of SmolLM2-135M quantized as shipped (the folders scripts/eval_ppl_formats.py writes under models/) against
its float32 checkpoint, in raylm, at batch 1 / 8 / 32.

Per batch size: that many requests of 32 random prompt tokens and --output-len greedy output tokens (ignore_eos),
each engine at `dtype: auto` (float32 for the float32 checkpoint; bfloat16 for the formats on a CPU with bfloat16
dot products, float32 elsewhere), or every engine at `--dtype float32`. Each folder runs in its own engine process
(scripts/offline_engine.py, warmed up once); the runs interleave, the order reversed every round, the others stopped
meanwhile (bench_offline.EngineProcess). Printed per format and batch: the median of the runs, their spread, output
tokens/s, the median of the per-round ratios float32 time / format time (above 1: faster than float32) and the
weights' bytes; and the machine's own matmul rate and the load average before and after.

    python scripts/bench_formats.py                                    # every folder present, batch 1 8 32, 5 runs
    python scripts/bench_formats.py --formats ct-w4a16 gptq-w4 --batch-sizes 1 --runs 1 --output-len 8
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.bench_common import machine_line, make_workload  # noqa: E402
from scripts.bench_offline import ENGINE_SETTINGS, EngineProcess  # noqa: E402
from scripts.eval_ppl_formats import FLOAT32, FORMATS  # noqa: E402


def folders(names: list[str]) -> dict[str, tuple[Path, str]]:
    """label -> (checkpoint folder, `quantization`): float32 first, then each format whose folder exists."""
    found = {"float32": (FLOAT32, "none")}
    for name in names:
        path = FLOAT32.with_name(f"smollm2-135m-{name}")
        if path.exists():
            found[name] = (path, FORMATS[name][3])
        else:
            print(f"{name}: no {path} (scripts/eval_ppl_formats.py --quantize-only writes it); left out",
                  file=sys.stderr)
    return found


def bench_batch(models: dict[str, tuple[Path, str]], batch: int, args: argparse.Namespace) -> None:
    prompts, output_lens = make_workload(batch, (32, 32), (args.output_len, args.output_len), 49152, args.seed)
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        processes = []
        try:
            for label, (path, method) in models.items():
                spec = dict(model=str(path), prompts=prompts, output_lens=output_lens, max_model_len=256,
                            settings=dict(ENGINE_SETTINGS, quantization=method, dtype=args.dtype,
                                          kv_cache_memory_gib=0.25, disable_log_stats=True),
                            threads=torch.get_num_threads())
                Path(tmp, f"{label}.json").write_text(json.dumps(spec))
                processes.append(EngineProcess("raylm", sys.executable, Path(tmp, f"{label}.json"), label=label))
            for round_index in range(args.runs):
                for process in processes if round_index % 2 == 0 else processes[::-1]:
                    times.setdefault(process.name, []).append(process.run())
                    print(f"  batch {batch} round {round_index + 1}: {process.name} {times[process.name][-1]:.2f} s",
                          file=sys.stderr)
        finally:
            for process in processes:
                process.close()
    tokens = sum(output_lens)
    for process in processes:
        runs = times[process.name]
        median = statistics.median(runs)
        ratio = statistics.median(f / q for f, q in zip(times["float32"], runs))
        print(f"| {process.name} | {batch} | {median:.2f} | {(max(runs) - min(runs)) / median * 100:.0f}% | "
              f"{tokens / median:.1f} | {ratio:.2f}x | {process.memory['weights'] / 2**20:.0f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="+", choices=list(FORMATS), default=list(FORMATS))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["auto", "float32"], default="auto",
                        help="every engine's dtype (auto: each checkpoint's own default)")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    models = folders(args.formats)
    print(f"{args.runs} interleaved runs, {torch.get_num_threads()} threads, 32 prompt and {args.output_len} output "
          f"tokens per request, dtype {args.dtype}\nbefore: {machine_line()}, load {os.getloadavg()[0]:.1f}",
          flush=True)
    print("| format | batch | median s | spread | output tok/s | vs float32 | weights MiB |\n" + "|---" * 7 + "|")
    for batch in args.batch_sizes:
        bench_batch(models, batch, args)
    print(f"after:  {machine_line()}, load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
