"""Offline throughput of raylm alone in float32 and in bfloat16 on the same checkpoint, interleaved: the measurement
behind `dtype: auto` on CPU (configs/model_info.py: resolve_dtype) and docs/cpu-performance.md, "bfloat16".

bench_offline.py's workload and protocol: N requests with random prompt and output lengths, ignore_eos, greedy,
prefix caching off; each dtype in its own engine process (scripts/offline_engine.py), warmed up, the runs alternating
while the other is stopped. Printed: each dtype's median output tokens/s and spread, the median of the per-round
ratios, the weights' bytes, and the machine's matmul rate before and after. Both runs load the same checkpoint, so
float32 computes the very values bfloat16 stores (a bfloat16 checkpoint upcast), and neither is favoured by its
weights.

    python scripts/bench_cpu_dtypes.py --model DIR [--runs 3] [--num-requests 48]

A GGUF file (`--model FILE.gguf`, e.g. the default SmolLM2 Q4_1) runs at its default quantization (`gguf`: the
blocks kept), in float32 (what `dtype: auto` chose for it until bfloat16 computed quantized models) and bfloat16.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raylm.configs.gguf_metadata import is_gguf, read_gguf_config  # noqa: E402
from scripts.bench_common import machine_line, make_workload, vocab_size  # noqa: E402
from scripts.bench_offline import ENGINE_SETTINGS, EngineProcess  # noqa: E402

DTYPES = ("float32", "bfloat16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="HF checkpoint folder (e.g. SmolLM2-135M)")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--input-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()

    model = Path(args.model)
    vocab = read_gguf_config(model).vocab_size if is_gguf(model) else vocab_size(model)
    prompts, output_lens = make_workload(args.num_requests, args.input_len, args.output_len, vocab, args.seed)
    before = machine_line()
    print(f"before: {before}", flush=True)
    times: dict[str, list[float]] = {dtype: [] for dtype in DTYPES}
    with tempfile.TemporaryDirectory() as tmp:
        processes = []
        for dtype in DTYPES:
            spec = dict(model=args.model, prompts=prompts, output_lens=output_lens, threads=args.threads,
                        max_model_len=args.input_len[1] + args.output_len[1],
                        settings=dict(ENGINE_SETTINGS, dtype=dtype, disable_log_stats=True))
            Path(tmp, f"{dtype}.json").write_text(json.dumps(spec))
            processes.append(EngineProcess("raylm", sys.executable, Path(tmp, f"{dtype}.json"), label=dtype))
        try:
            for round_index in range(args.runs):
                for process in processes if round_index % 2 == 0 else processes[::-1]:
                    times[process.name].append(process.run())
                    print(f"  round {round_index + 1}: {process.name} {times[process.name][-1]:.2f} s", file=sys.stderr,
                          flush=True)
        finally:
            for process in processes:
                process.close()
    tokens = sum(output_lens)
    print(f"\n{args.model}: {args.num_requests} requests, input {args.input_len[0]}-{args.input_len[1]}, output "
          f"{args.output_len[0]}-{args.output_len[1]} tokens ({tokens} in all), greedy, {args.threads} threads\n"
          "| dtype | median s | spread | output tok/s | vs float32 | weights MiB |\n|---|---|---|---|---|---|")
    for process in processes:
        runs = times[process.name]
        median = statistics.median(runs)
        ratio = statistics.median(f / b for f, b in zip(times["float32"], runs, strict=True))
        spread = (max(runs) - min(runs)) / median * 100
        print(f"| {process.name} | {median:.2f} | {spread:.0f}% | {tokens / median:.1f} | {ratio:.2f}x | "
              f"{process.memory['weights'] / 2**20:.0f} |")
    print(f"(median of {args.runs} interleaved runs; vs float32: the median of the per-round ratios)\n"
          f"before: {before}\nafter:  {machine_line()}")


if __name__ == "__main__":
    main()
