"""The `raylm` command: `generate` offline, `serve` the OpenAI API (on Ray Serve, or in this process), `run-batch` an
OpenAI Batch file, `bench serve` a running server."""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

from raylm.configs import EngineConfig, add_engine_args, engine_args_from, make_engine_config

CONFIG_HELP = "YAML file of settings: a path, or the name of a preset in raylm/configs/"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="raylm", description="An LLM serving engine for Ray clusters.")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate text for prompts, offline")
    generate.add_argument("prompts", nargs="*", help="prompts (default: two examples)")
    generate.add_argument("--config", dest="config_file", help=CONFIG_HELP)
    generate.add_argument("--max-tokens", type=int, default=32)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--sampling-seed", type=int, default=None, help="seed of the sampled requests")
    generate.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                          help="send each prompt as a user message through the model's chat template (default: on "
                               "for the default SmolLM2-135M-Instruct, off for other models)")
    add_engine_args(generate)
    generate.add_argument("--trace", dest="trace_file", default=None, help="same as --trace-file")

    serve = commands.add_parser("serve", help="serve the OpenAI API: a Ray Serve app, or uvicorn with --no-ray")
    serve.add_argument("--config", dest="config_file", help=CONFIG_HELP)
    serve.add_argument("--no-ray", action="store_true",
                       help="run the app and one engine in this process under uvicorn (no Ray Serve)")
    serve.add_argument("--ray-address", default=None,
                       help="Ray cluster to join (default: $RAY_ADDRESS, else the local `ray start` cluster, "
                            "else a new local Ray)")
    add_engine_args(serve)
    serve.add_argument("--trace", dest="trace_file", default=None, help="same as --trace-file")

    from raylm.cluster.batch import run_batch

    run_batch.add_arguments(commands.add_parser(
        "run-batch", help="answer an OpenAI Batch file (JSONL): one engine here, or a Ray Data pool (--concurrency)"),
        CONFIG_HELP)

    bench = commands.add_parser("bench", help="benchmarks")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    from raylm.cluster.tools import serving_benchmark

    serving_benchmark.add_arguments(bench_commands.add_parser(
        "serve", help="streaming clients against an OpenAI-compatible server: latency and throughput sweeps"))

    args = parser.parse_args(argv)
    try:
        if args.command == "bench":
            return serving_benchmark.run(args)
        if args.command == "run-batch":
            return run_batch.run(args)
        return _serve(args) if args.command == "serve" else _generate(args)
    except (ValueError, TimeoutError) as err:  # bad settings; a cluster that cannot (or did not) make room
        print(f"raylm: error: {err}", file=sys.stderr)
        return 2


def _generate(args: argparse.Namespace) -> int:
    from raylm.cluster.entrypoints.llm import LLM
    from raylm.cluster.models.default_model import is_default_chat_model
    from raylm.common.sampling_params import SamplingParams

    settings: dict[str, Any] = engine_args_from(args)
    llm = LLM(config_file=args.config_file, **settings)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed)
    prompts = args.prompts or ["The quick brown fox", "Once upon a time"]
    model = llm.llm_engine.config.model_config.model
    assert model is not None, "resolution names the model (the default one when none was given)"
    chat = args.chat if args.chat is not None else is_default_chat_model(model)
    try:
        outputs = (llm.chat([[{"role": "user", "content": p}] for p in prompts], params) if chat
                   else llm.generate(prompts, params))
        for prompt, output in zip(prompts, outputs):
            completion = output.outputs[0]
            print(f"{prompt!r} -> {completion.text!r} ({len(completion.token_ids)} tokens, "
                  f"{completion.finish_reason})")
    finally:
        llm.shutdown()
    return 0


def _serve(args: argparse.Namespace) -> int:
    config = make_engine_config(args.config_file, **engine_args_from(args))
    if args.no_ray:
        from raylm.cluster.entrypoints.openai.api_server import run_server

        return run_server(config)
    return _serve_on_ray(config, args.ray_address)


def _serve_on_ray(config: EngineConfig, address: str | None) -> int:
    """Deploys the Serve app, then holds it until Ctrl-C or SIGTERM (`ray job stop`) and shuts Serve down.
    Inside `ray job submit`, RAY_ADDRESS points ray.init at the job's cluster."""
    import ray
    from ray import serve

    from raylm.cluster.serve.app import build_openai_app, start_serve

    ray.init(address=address)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own SIGTERM handler
        signal.signal(signum, lambda *_: stop.set())
    try:
        serving = config.serving_config
        start_serve(serving.host, serving.port)
        serve.run(build_openai_app(config), name="raylm", route_prefix="/", blocking=False)
        print(f"raylm: serving {config.model_config.served_model_name} at http://{serving.host}:{serving.port}/v1 "
              f"(Ctrl-C to stop)", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
