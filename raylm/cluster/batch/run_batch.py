"""`raylm run-batch -i requests.jsonl -o results.jsonl`: an OpenAI Batch file through one engine in this process, or
through a Ray Data pool of `--concurrency` replicas. The output keeps the input's line order. Input and output are
local paths or URIs: pyarrow.fs's schemes (file://, s3://, gs://, hdfs://), else any fsspec filesystem. Ray Data and
the engine load only when the command runs, not when the CLI reads its flags."""
from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs
from tqdm import tqdm

from raylm.configs import EngineConfig, add_engine_args, engine_args_from, make_engine_config


def add_arguments(parser: argparse.ArgumentParser, config_help: str) -> None:
    parser.add_argument("-i", "--input-file", required=True, help="the OpenAI Batch file of requests (path or URI)")
    parser.add_argument("-o", "--output-file", required=True, help="where the output lines go (path or URI)")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="answer on a Ray Data pool of this many engine replicas (default: one engine here)")
    parser.add_argument("--batch-size", type=int, default=64, help="requests per Ray Data batch (with --concurrency)")
    parser.add_argument("--max-concurrent-batches", type=int, default=4,
                        help="batches each replica holds in its engine at once (with --concurrency)")
    parser.add_argument("--ray-address", default=None, help="Ray cluster to join (with --concurrency; default: "
                                                            "$RAY_ADDRESS, else a local one)")
    parser.add_argument("--config", dest="config_file", help=config_help)
    add_engine_args(parser)


def run(args: argparse.Namespace) -> int:
    from raylm.cluster.batch.openai_batch import parse_request

    lines = [line for line in read_text(args.input_file).splitlines() if line.strip()]
    requests = [parse_request(line, number) for number, line in enumerate(lines, 1)]  # the whole file, up front
    config = make_engine_config(args.config_file, **engine_args_from(args))
    with tqdm(total=len(requests), desc="Answered requests", dynamic_ncols=True) as progress:
        if args.concurrency is None:
            outputs = asyncio.run(_answer_here(config, lines, progress))
        else:
            outputs = _answer_on_pool(config, lines, args, progress)
    write_text(args.output_file, "".join(json.dumps(output) + "\n" for output in outputs))
    failed = sum(output["error"] is not None for output in outputs)
    print(f"raylm: {len(outputs)} requests answered ({failed} with an error) -> {args.output_file}")
    return 0


async def _answer_here(config: EngineConfig, lines: list[str], progress: tqdm) -> list[dict[str, Any]]:
    """Every request in the engine at once: its scheduler batches them as max_num_seqs allows."""
    from raylm.cluster.batch.openai_batch import answer, parse_request
    from raylm.cluster.engine.async_llm import AsyncLLM
    from raylm.cluster.entrypoints.openai.api_server import model_router

    engine = AsyncLLM(config, usage_context="openai_batch_runner")
    try:
        await engine.wait_until_ready()
        router = model_router(engine)

        async def one(number: int, line: str) -> dict[str, Any]:
            output = await answer(router, parse_request(line, number))
            progress.update(1)
            return output

        return list(await asyncio.gather(*[one(number, line) for number, line in enumerate(lines, 1)]))
    finally:
        engine.shutdown()


def _answer_on_pool(config: EngineConfig, lines: list[str], args: argparse.Namespace,
                    progress: tqdm) -> list[dict[str, Any]]:
    import ray
    import ray.data

    from raylm.cluster.batch.openai_batch import OpenAIBatchUDF
    from raylm.cluster.batch.processor import map_through_replicas
    from raylm.cluster.batch.processor_config import EngineProcessorConfig

    ray.init(address=args.ray_address, ignore_reinit_error=True)
    pool = EngineProcessorConfig(concurrency=args.concurrency, batch_size=args.batch_size,
                                 max_concurrent_batches=args.max_concurrent_batches)
    dataset = ray.data.from_items([{"line_number": number, "request": line} for number, line in enumerate(lines, 1)])
    answered = map_through_replicas(dataset, OpenAIBatchUDF, {"engine_config": config}, pool, config)
    outputs: dict[int, dict[str, Any]] = {}
    for row in answered.iter_rows():
        outputs[row["line_number"]] = json.loads(row["output"])
        progress.update(1)
    return [outputs[number] for number in range(1, len(lines) + 1)]


def read_text(uri: str) -> str:
    if "://" not in uri:
        return Path(uri).read_text(encoding="utf-8")
    arrow = _arrow_filesystem(uri)
    if arrow is not None:
        filesystem, path = arrow
        with filesystem.open_input_stream(path) as stream:
            return stream.read().decode("utf-8")
    with _fsspec_open(uri, "r") as file:
        return str(file.read())


def write_text(uri: str, text: str) -> None:
    if "://" not in uri:
        Path(uri).write_text(text, encoding="utf-8")
        return
    arrow = _arrow_filesystem(uri)
    if arrow is not None:
        filesystem, path = arrow
        with filesystem.open_output_stream(path) as stream:
            stream.write(text.encode("utf-8"))
        return
    with _fsspec_open(uri, "w") as file:
        file.write(text)


def _fsspec_open(uri: str, mode: str) -> Any:
    import fsspec

    return fsspec.open(uri, mode, encoding="utf-8")


def _arrow_filesystem(uri: str) -> tuple[pyarrow.fs.FileSystem, str] | None:
    """pyarrow's filesystem for `uri`, or None for a scheme it does not know (fsspec's then)."""
    try:
        return pyarrow.fs.FileSystem.from_uri(uri)
    except pa.ArrowInvalid:
        return None
