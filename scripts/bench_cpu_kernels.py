"""raylm's CPU kernels as this CPU builds them (`-march=native`) beside the same sources built for AVX2 + FMA alone
(`cpu_kernels.load_avx2`, what an AVX2-only CPU runs), on SmolLM2-135M's shapes: paged attention over a prefill and
two decode batches, SiLU-and-mul, the residual RMSNorm and the skinny linear. On an AVX-512 CPU the ratio shows what
the AVX2 build costs here (a kernel whose AVX2 build falls far behind has lost its vectors there); on an AVX2-only
CPU the two builds target about the same instructions, and without AVX2 only the native column is printed.

Both builds' calls interleave, each figure is the median of the rounds, and both builds' outputs are checked against
each other first.

`--bf16` times the skinny linear on bfloat16 weights against float32 ones instead, at 1, 8, 32 and 64 rows on
SmolLM2's linears (qkv, o, gate_up, down, the 49152-row lm_head), each over enough copies of its weight to outgrow
the caches (--cold-mib of float32 weights): the native build (AVX512-BF16's dot products where the CPU has them)
and the AVX2 build (the bfloat16 pairs widened, then FMAs), with oneDNN's float32 and bfloat16 matmul beside them.

    python scripts/bench_cpu_kernels.py [--rounds 9]
    python scripts/bench_cpu_kernels.py --bf16 [--rounds 5] [--cold-mib 512] [--threads 1]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raylm.runner import cpu_kernels  # noqa: E402
from scripts.bench_common import machine_line  # noqa: E402

# SmolLM2-135M: 9 query heads over 3 KV heads of 64, hidden 576, MLP 1536, 30 layers; raylm's KV block of 16.
HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, HIDDEN, INTERMEDIATE, LAYERS = 9, 3, 64, 16, 576, 1536, 30


def attention_case(query_lens: list[int], seq_lens: list[int], layers: int,
                   seed: int = 0) -> Callable[[ModuleType], torch.Tensor]:
    """One paged-attention call per layer over its own cache (blocks scattered over the pool), as a step makes."""
    generator = torch.Generator().manual_seed(seed)
    blocks = [(n + BLOCK_SIZE - 1) // BLOCK_SIZE for n in seq_lens]
    pool = sum(blocks) + 4
    caches = [torch.randn(2, pool, KV_HEADS, BLOCK_SIZE, HEAD_SIZE, generator=generator) for _ in range(layers)]
    order = torch.randperm(pool, generator=generator).int()
    block_table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    used = 0
    for row, n in enumerate(blocks):
        block_table[row, :n] = order[used:used + n]
        used += n
    query = torch.randn(sum(query_lens), HEADS, HEAD_SIZE, generator=generator)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)

    def run(ops: ModuleType) -> torch.Tensor:
        out = torch.empty_like(query)
        for cache in caches:
            ops.paged_attention(out, query, cache[0], cache[1], block_table, lens, query_start_loc, HEAD_SIZE ** -0.5)
        return out
    return run


def linear_case(rows: int, out: int, inp: int, copies: int = 8) -> Callable[[ModuleType], torch.Tensor]:
    """The skinny linear over `copies` weights in turn (a decode step streams its weights from memory)."""
    weights = [torch.randn(out, inp) * 0.05 for _ in range(copies)]
    x = torch.randn(rows, inp)
    packed: dict[str, list[torch.Tensor]] = {}

    def run(ops: ModuleType) -> torch.Tensor:
        if ops.__name__ not in packed:
            packed[ops.__name__] = [ops.pack_skinny(w) for w in weights]
        return [ops.skinny_linear(x, panel, out, None) for panel in packed[ops.__name__]][-1]
    return run


def cases() -> dict[str, Callable[[ModuleType], torch.Tensor]]:
    rng = random.Random(0)
    prompts = [rng.randint(16, 256) for _ in range(15)]
    contexts = [rng.randint(100, 384) for _ in range(48)]
    gate_up = torch.randn(512, 2 * INTERMEDIATE)
    x, residual, weight = torch.randn(48, HIDDEN), torch.randn(48, HIDDEN), torch.rand(HIDDEN) + 0.5

    def add_rms_norm(ops: ModuleType) -> torch.Tensor:
        out, res = x.clone(), residual.clone()
        ops.fused_add_rms_norm(out, res, weight, 1e-5)
        return out
    return {
        f"attention: prefill of {len(prompts)} prompts, {LAYERS // 3} layers": attention_case(prompts, prompts,
                                                                                              LAYERS // 3),
        f"attention: decode of 48, {LAYERS} layers": attention_case([1] * 48, contexts, LAYERS),
        f"attention: decode of 8, {LAYERS} layers": attention_case([1] * 8, contexts[:8], LAYERS),
        "silu_and_mul 512 x 1536": lambda ops: ops.silu_and_mul(gate_up),
        "fused_add_rms_norm 48 x 576": add_rms_norm,
        "skinny linear gate_up, 8 rows": linear_case(8, 2 * INTERMEDIATE, HIDDEN),
        "skinny linear down, 48 rows": linear_case(48, HIDDEN, INTERMEDIATE),
    }


# SmolLM2-135M's linears: (name, out, in).
SMOLLM2_LINEARS = [("qkv", (HEADS + 2 * KV_HEADS) * HEAD_SIZE, HIDDEN), ("o", HIDDEN, HEADS * HEAD_SIZE),
                   ("gate_up", 2 * INTERMEDIATE, HIDDEN), ("down", HIDDEN, INTERMEDIATE), ("lm_head", 49152, HIDDEN)]


Call = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def bf16_calls(out: int, weights: list[torch.Tensor]) -> dict[str, tuple[Call, list[torch.Tensor], bool]]:
    """kernel -> (call on x and one packed weight, the packed weights, whether it takes bfloat16)."""
    native, avx2 = cpu_kernels.load(), cpu_kernels.load_avx2()
    assert native is not None, "raylm's CPU kernels did not build"
    bf16 = [w.bfloat16() for w in weights]
    linear = torch.ops.mkldnn._linear_pointwise
    calls: dict[str, tuple[Call, list[torch.Tensor], bool]] = {
        "skinny fp32": (lambda x, w: native.skinny_linear(x, w, out, None), [native.pack_skinny(w) for w in weights],
                        False),
        "skinny bf16": (lambda x, w: native.skinny_linear(x, w, out, None), [native.pack_skinny(w) for w in bf16],
                        True),
    }
    if avx2 is not None:
        calls["avx2 bf16"] = (lambda x, w: avx2.skinny_linear(x, w, out, None), [avx2.pack_skinny(w) for w in bf16],
                              True)
    calls["onednn fp32"] = (lambda x, w: linear(x, w, None, "none", [], ""),
                            [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights], False)
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        calls["onednn bf16"] = (lambda x, w: linear(x, w, None, "none", [], ""),
                                [torch.ops.mkldnn._reorder_linear_weight(w) for w in bf16], True)
    return calls


def bf16_linears(rounds: int, cold_mib: int) -> None:
    """The bfloat16 table: per shape and rows, ms per call of each kernel and the float32 / bfloat16 ratio."""
    print(f"native build multiplies bfloat16 pairs natively: {cpu_kernels.load().native_bf16}; oneDNN bfloat16: "
          f"{torch.ops.mkldnn._is_mkldnn_bf16_supported()}", flush=True)
    header_done = False
    for name, out, inp in SMOLLM2_LINEARS:
        copies = max(1, cold_mib * 2**20 // (out * inp * 4))
        calls = bf16_calls(out, [torch.randn(out, inp) * 0.05 for _ in range(copies)])
        if not header_done:
            header = ["linear", "rows", *calls, "fp32 / bf16 (skinny)"]
            print("| " + " | ".join(header) + " |\n|" + "---|" * len(header), flush=True)
            header_done = True
        for rows in (1, 8, 32, 64):
            x32 = torch.randn(rows, inp)
            inputs = {False: x32, True: x32.bfloat16()}
            times: dict[str, list[float]] = {kernel: [] for kernel in calls}
            for _ in range(rounds + 1):  # the first round warms up
                for kernel, (call, packed, is_bf16) in calls.items():
                    start = time.perf_counter()
                    for w in packed:
                        call(inputs[is_bf16], w)
                    times[kernel].append((time.perf_counter() - start) / len(packed))
            ms = {kernel: statistics.median(t[1:]) * 1e3 for kernel, t in times.items()}
            row = [f"{name} {out}x{inp}", str(rows), *(f"{v:.3f}" for v in ms.values()),
                   f"{ms['skinny fp32'] / ms['skinny bf16']:.2f}x"]
            print("| " + " | ".join(row) + " |", flush=True)
    print(f"\nms per call (median of {rounds} rounds over the copies), {torch.get_num_threads()} threads")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--bf16", action="store_true", help="the skinny linear in bfloat16 against float32")
    parser.add_argument("--cold-mib", type=int, default=512, help="--bf16: float32 MiB of weight copies per shape")
    parser.add_argument("--threads", type=int, help="torch's threads (default: torch's own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.bf16:
        before = machine_line()
        print(f"before: {before}", flush=True)
        bf16_linears(args.rounds, args.cold_mib)
        print(f"after:  {machine_line()}")
        return
    builds = {"native": cpu_kernels.load(), "avx2": cpu_kernels.load_avx2()}
    assert builds["native"] is not None, "raylm's CPU kernels did not build"
    builds = {name: ops for name, ops in builds.items() if ops is not None}
    before = machine_line()
    print(before, file=sys.stderr)
    header = ["kernel", *[f"{name} (ms)" for name in builds], *(["avx2 / native"] if len(builds) == 2 else [])]
    rows = []
    for name, run in cases().items():
        outputs = {build: run(ops) for build, ops in builds.items()}  # warm-up, and the builds agree
        for output in outputs.values():
            torch.testing.assert_close(output, outputs["native"], rtol=1e-4, atol=1e-4)
        times: dict[str, list[float]] = {build: [] for build in builds}
        for _ in range(args.rounds):
            for build, ops in builds.items():
                start = time.perf_counter()
                run(ops)
                times[build].append(time.perf_counter() - start)
        medians = {build: statistics.median(t) * 1e3 for build, t in times.items()}
        ratio = [f"{medians['avx2'] / medians['native']:.2f}x"] if len(builds) == 2 else []
        rows.append([name, *[f"{v:.2f}" for v in medians.values()], *ratio])
        print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\n{torch.get_num_threads()} threads, median of {args.rounds} interleaved calls\nbefore: {before}\n"
          f"after:  {machine_line()}")


if __name__ == "__main__":
    main()
