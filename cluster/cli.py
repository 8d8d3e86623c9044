"""The `raylm` command: `generate` now; `serve` and `bench` join it as they land."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from configs import add_engine_args, engine_args_from


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="raylm", description="An LLM serving engine for Ray clusters.")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate text for prompts, offline")
    generate.add_argument("prompts", nargs="*", help="prompts (default: two examples)")
    generate.add_argument("--config", dest="config_file", help="YAML file of settings (configs/*.yaml)")
    generate.add_argument("--max-tokens", type=int, default=32)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--sampling-seed", type=int, default=None, help="seed of the sampled requests")
    add_engine_args(generate)

    args = parser.parse_args(argv)
    try:
        return _generate(args)
    except ValueError as err:
        print(f"raylm: error: {err}", file=sys.stderr)
        return 2


def _generate(args: argparse.Namespace) -> int:
    from cluster.llm import LLM
    from runner.sampling_params import SamplingParams

    settings: dict[str, Any] = engine_args_from(args)
    llm = LLM(config_file=args.config_file, **settings)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed)
    prompts = args.prompts or ["The quick brown fox", "Once upon a time"]
    try:
        for output in llm.generate(prompts, params):
            completion = output.outputs[0]
            print(f"{output.prompt!r} -> {completion.text!r} ({len(completion.token_ids)} tokens, "
                  f"{completion.finish_reason})")
    finally:
        llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
