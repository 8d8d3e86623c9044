"""Multi-LoRA throughput: the same N requests on the base model and spread over 1, 4 and 8 distinct adapters (round
robin), for adapter ranks 8, 16 and 64, in one run. Each setting is its own engine (max_loras = the adapters, and
max_lora_rank = the rank: what a user would configure), all built and warmed up first; then the runs alternate
(base, then every LoRA setting, round after round) so that the machine's noise hits each alike. Adapters are random
PEFT checkpoints written here (all seven linears targeted). Printed: each setting's median time and spread, tokens/s,
and its throughput over the base model's (ratio of medians, and the median of the per-round ratios), beside the
machine's matmul rate and Python speed. Target (issue 26): >= 0.8x the base with 8 adapters of rank 16 on the 5m model.
    python scripts/bench_lora.py                 # the 5m model, 48 requests
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from raylm.cluster import LLM, SamplingParams  # noqa: E402
from raylm.common.lora_request import LoRARequest  # noqa: E402
from raylm.runner.lora.peft_checkpoint import expected_shapes  # noqa: E402
from scripts.bench_common import MODELS_DIR, PRESETS, machine_line, make_workload, preset_model, vocab_size  # noqa: E402

# Ten engines live at once: each keeps a KV cache of 0.1 GiB (the workload needs ~75 MiB), not the 1 GiB default.
ENGINE_SETTINGS = dict(max_num_seqs=64, max_num_batched_tokens=2048, enable_prefix_caching=False,
                       disable_log_stats=True, kv_cache_memory_gib=0.1)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(model: Path, out: Path, rank: int, seed: int) -> Path:
    """A PEFT LoRA folder with random non-zero A and B on every decoder linear (what PEFT saves)."""
    if (out / "adapter_model.safetensors").exists():
        return out
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for kind, (out_features, in_features) in expected_shapes(config).items():
            block = "self_attn" if kind in TARGETS[:4] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{kind}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
        "base_model_name_or_path": str(model), "bias": "none"}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=PRESETS, default="5m")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--input-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model = preset_model(args.preset)
    prompts, output_lens = make_workload(args.num_requests, args.input_len, args.output_len, vocab_size(model),
                                         args.seed)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in output_lens]
    max_model_len = args.input_len[1] + args.output_len[1]
    print(machine_line(), file=sys.stderr)
    load_before = os.getloadavg()[0]

    settings: dict[str, tuple[LLM, list[LoRARequest | None]]] = {
        "base": (LLM(str(model), max_model_len=max_model_len, **ENGINE_SETTINGS), [None] * len(prompts))}
    for rank in args.ranks:
        adapters = [write_adapter(model, MODELS_DIR / f"lora-{args.preset}-r{rank}-{i}", rank, seed=rank * 100 + i)
                    for i in range(max(args.adapters))]
        for count in args.adapters:
            loras = [LoRARequest(f"r{rank}-{i}", i + 1, str(adapters[i])) for i in range(count)]
            llm = LLM(str(model), max_model_len=max_model_len, enable_lora=True, max_loras=count,
                      max_lora_rank=rank, **ENGINE_SETTINGS)
            settings[f"{count} x rank {rank}"] = (llm, [loras[i % count] for i in range(len(prompts))])
    for llm, loras in settings.values():  # warm-up: the adapters read, the kernels planned
        llm.generate(inputs[:8], params[:8], use_tqdm=False, lora_request=loras[:8])

    times: dict[str, list[float]] = {name: [] for name in settings}
    for round_index in range(args.runs):
        for name, (llm, loras) in settings.items():
            start = time.perf_counter()
            outputs = llm.generate(inputs, params, use_tqdm=False, lora_request=loras)
            times[name].append(time.perf_counter() - start)
            assert sum(len(o.outputs[0].token_ids) for o in outputs) == sum(output_lens)
            print(f"  round {round_index + 1}: {name} {times[name][-1]:.2f} s", file=sys.stderr)
    for llm, _ in settings.values():
        llm.shutdown()

    print(machine_line())
    # Other processes on the machine slow every setting alike but widen the spread: the 1-minute load says how many.
    print(f"load average (1 min): {load_before:.1f} before the runs, {os.getloadavg()[0]:.1f} after, "
          f"{os.cpu_count()} CPUs")
    print(f"model {args.preset} ({model.name}), {args.num_requests} requests, prompts {args.input_len[0]}-"
          f"{args.input_len[1]} tokens, outputs {args.output_len[0]}-{args.output_len[1]} ({sum(output_lens)} tokens), "
          f"greedy, float32, {torch.get_num_threads()} threads, median of {args.runs} interleaved runs")
    # On a shared machine the best run is the least disturbed one: its ratio is printed beside the medians'.
    print(f"{'setting':<16}{'median s':>10}{'best s':>8}{'spread':>8}{'tok/s':>9}{'vs base':>17}{'best vs best':>14}")
    base = times["base"]
    for name, runs in times.items():
        median = statistics.median(runs)
        spread = (max(runs) - min(runs)) / median * 100
        ratio = best_ratio = ""
        if name != "base":
            paired = statistics.median(b / t for b, t in zip(base, runs))
            ratio = f"{statistics.median(base) / median:.2f}x ({paired:.2f}x)"
            best_ratio = f"{min(base) / min(runs):.2f}x"
        print(f"{name:<16}{median:>10.2f}{min(runs):>8.2f}{spread:>7.0f}%{sum(output_lens) / median:>9.0f}{ratio:>17}"
              f"{best_ratio:>14}")


if __name__ == "__main__":
    main()
