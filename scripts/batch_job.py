"""A batch inference job: a JSONL or Parquet dataset of prompts through a pool of raylm engine replicas (raylm.data),
written as Parquet or JSONL. Run it on a Ray cluster as a job (the working dir ships raylm to every node):

    RAY_AUTH_MODE=token ray job submit --address http://<head-ip>:8265 --working-dir . -- \\
        python scripts/batch_job.py --input s3://bucket/prompts.jsonl --output s3://bucket/results/ \\
        --model /models/Qwen3-8B --concurrency 2,8 --engine-kwargs '{"tensor_parallel_size": 2}'

or here, on a local Ray: `python scripts/batch_job.py --input prompts.jsonl --output results/`. Each input row has a
`prompt` (text) or `messages` (chat) and may carry its own `sampling_params` (a dict); rows without take
--max-tokens / --temperature. The output has the input's columns and generated_text, generated_tokens,
num_input_tokens, num_generated_tokens, finish_reason, time_to_first_token, time_taken_llm (docs/batch.md).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import ray
import ray.data

from raylm.data import EngineProcessorConfig, build_processor


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="JSONL or Parquet file or folder (path or URI)")
    parser.add_argument("--input-format", choices=["jsonl", "parquet"], default=None,
                        help="default: from the input's extension")
    parser.add_argument("--output", required=True, help="the output folder (path or URI)")
    parser.add_argument("--output-format", choices=["jsonl", "parquet"], default="parquet")
    parser.add_argument("--model", default=None, help="checkpoint path or GGUF file (default: raylm's default model)")
    parser.add_argument("--engine-kwargs", type=json.loads, default={}, help="raylm engine settings, as JSON")
    parser.add_argument("--concurrency", default="1", help="replicas: n, or min,max for an autoscaling pool")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-concurrent-batches", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64, help="for rows without sampling_params")
    parser.add_argument("--temperature", type=float, default=0.0, help="for rows without sampling_params")
    parser.add_argument("--should-continue-on-error", action="store_true",
                        help="record a failed row's error in its __inference_error__ column instead of failing")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = [int(size) for size in args.concurrency.split(",")]
    if len(sizes) not in (1, 2):
        raise SystemExit(f"--concurrency: n or min,max; got {args.concurrency!r}")
    config = EngineProcessorConfig(
        model_source=args.model, engine_kwargs=args.engine_kwargs,
        concurrency=sizes[0] if len(sizes) == 1 else (sizes[0], sizes[1]), batch_size=args.batch_size,
        max_concurrent_batches=args.max_concurrent_batches, should_continue_on_error=args.should_continue_on_error)
    defaults = {"max_tokens": args.max_tokens, "temperature": args.temperature}

    def with_sampling_params(row: dict[str, Any]) -> dict[str, Any]:
        return {**row, "sampling_params": row.get("sampling_params") or defaults}

    ray.init()  # inside `ray job submit`, RAY_ADDRESS points at the job's cluster
    input_format = args.input_format or ("parquet" if args.input.rstrip("/").endswith(".parquet") else "jsonl")
    dataset = ray.data.read_parquet(args.input) if input_format == "parquet" else ray.data.read_json(args.input)
    results = build_processor(config, preprocess=with_sampling_params)(dataset)
    start = time.perf_counter()
    if args.output_format == "parquet":
        results.write_parquet(args.output)
    else:
        results.write_json(args.output)
    elapsed = time.perf_counter() - start
    written = ray.data.read_parquet(args.output) if args.output_format == "parquet" else ray.data.read_json(args.output)
    num_rows = written.count()
    print(f"batch_job: {num_rows} rows -> {args.output} in {elapsed:.1f} s ({num_rows / elapsed:.2f} rows/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
