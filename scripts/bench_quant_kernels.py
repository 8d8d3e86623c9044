"""Weight-only quantized matmul kernels on CPU, side by side on one model's weight shapes: float32 F.linear, torch's own
weight-only ops (`_weight_int8pack_mm`: int8, one scale per output channel; `_weight_int4pack_mm_for_cpu`: 4-bit
groups of 32 with a scale and a zero, fed float32 or bfloat16 activations), raylm's block kernels (Q8_0, Q4_1), its
kernel on int8 activations (`int8`: bfloat16 x quantized to int8 per block, integer dot products; llama.cpp's few-row
scheme), its AMX kernel where the CPU has AMX-BF16 (bfloat16 activations, panels of blocks decoded to bfloat16 in
cache), its AVX512-BF16 one where the build has that (`dot`: blocks decoded to bfloat16 for vdpbf16ps) and the float
kernels a quantized layer's GEMM plan weighs against them (runner/layers/cpu_gemm.py): sgemm, oneDNN and the skinny
kernel on a dequantized copy, float32 for float32 activations, bfloat16 for bfloat16 ones (`dtype: auto` for a
quantized model on a CPU with bfloat16 dot products), where the block kernel takes x upcast and rounds its result.
A summary follows: per batch, each quantized layer against float32 (best of sgemm, oneDNN, skinny): the block kernel
alone (raylm before its plan took quantized layers), planned in float32 (the faster of the block kernel and float32's
kernels on a float32 copy) and planned in bfloat16 (the fastest of the block kernel, the AMX and AVX512-BF16 kernels
and bfloat16's on a bfloat16 copy), without and with the int8 kernel, and the block kernels alone in bfloat16 (what a
checkpoint format's plan weighs: no copy).

Each kernel cycles through enough copies of its weights to overflow the CPU caches (as a decode step streams every
layer's weights from memory), the kernels' calls interleave, and each figure is the median of the rounds, or with
`--best` the fastest round (as the plan itself times: on a machine shared with other work, a round that lost its core
to a neighbour is noise, not the kernel). With `--cpu-time` each call runs on one thread and counts its CPU time
(time.thread_time): a call that lost its core to a neighbour does not count the wait. torch's int4
op runs Q4_1's exact numbers (zero = m + 8 d); its int8 op needs per-channel scales, so it gets its own quantization.

    python scripts/bench_quant_kernels.py [--shapes smollm2|100m] [--rows 1 8 32 64] [--rounds 15] [--no-torch]
        [--best] [--cpu-time]

An AVX2-only CPU's table, on an AVX-512 one (oneDNN's bfloat16 column is left out where oneDNN cannot pack bfloat16):

    PYTHONPATH=scripts/emulate_avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        python scripts/bench_quant_kernels.py --rows 1 8 32 64 --best --no-torch
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raylm.runner import cpu_kernels  # noqa: E402
from raylm.runner.layers.cpu_gemm import onednn_packs  # noqa: E402
from raylm.runner.layers.quantization import kernels  # noqa: E402
from raylm.runner.layers.quantization.ggml_blocks import Q4_1, Q8_0, dequantize, quantize  # noqa: E402
from scripts.bench_common import machine_line  # noqa: E402

# (name, out_features, in_features, layers of that shape in the model): the fused layers as raylm runs them.
SHAPES = {
    "smollm2": [("qkv_proj", 960, 576, 30), ("o_proj", 576, 576, 30), ("gate_up_proj", 3072, 576, 30),
                ("down_proj", 576, 1536, 30), ("lm_head", 49152, 576, 1)],
    "100m": [("qkv_proj", 1280, 768, 12), ("o_proj", 768, 768, 12), ("gate_up_proj", 6144, 768, 12),
             ("down_proj", 768, 3072, 12)],
}
_STREAM_BYTES = 256 << 20  # float32 weight copies per shape: past any last-level cache here


def _torch_int4(packed_q4_1: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_1 blocks as torch's int4 CPU layout: q unchanged, scale d, zero m + 8 d (its (q - 8) * scale + zero)."""
    blocks = packed_q4_1.reshape(n, -1, Q4_1.type_bytes)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)
    q = torch.cat([blocks[..., 4:] & 15, blocks[..., 4:] >> 4], dim=-1).reshape(n, k).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    return packed, torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1).contiguous()


def kernels_for_shape(n: int, k: int, copies: int,
                      with_torch: bool) -> dict[str, Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]]:
    """name -> call(x in float32, the same x in bfloat16, copy index), each checked against its
    dequantize-then-matmul on one input first. Names starting "bf16" take bfloat16 activations and give bfloat16."""
    floats = [torch.randn(n, k) * 0.05 for _ in range(copies)]
    ops, quant_ops = cpu_kernels.load(), kernels.load()
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w) for w in floats]
    skinny = [ops.pack_skinny(w) for w in floats]
    bf16 = [w.bfloat16() for w in floats]
    # oneDNN packs bfloat16 only where its bfloat16 kernels run (not on an AVX2-only CPU or under its emulation).
    onednn_bf16 = [torch.ops.mkldnn._reorder_linear_weight(w) for w in bf16] if onednn_packs(torch.bfloat16) else []
    skinny_bf16 = [ops.pack_skinny(w) for w in bf16]
    # Each block kernel reads copies of its own: one run after another on the same copy would find it in cache.
    q8, q4 = {}, {}
    for kernel in ("f32", "bf16", "int8", "amx", "dot"):
        q8[kernel], q4[kernel] = [quantize(w, Q8_0) for w in floats], [quantize(w, Q4_1) for w in floats]
    scales = [w.abs().amax(1) / 127 for w in floats]
    int8 = [torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8) for w, s in zip(floats, scales)]
    int4 = [_torch_int4(p, n, k) for p in q4["f32"]]
    int4_bf16 = [(p, sz.bfloat16()) for p, sz in int4]
    Call = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
    calls: dict[str, Call] = {
        "float32": lambda x, xb, i: F.linear(x, floats[i]),
        "float32 onednn": lambda x, xb, i: torch.ops.mkldnn._linear_pointwise(x, onednn[i], None, "none", [], ""),
        "float32 skinny": lambda x, xb, i: ops.skinny_linear(x, skinny[i], n, None),
        "bf16 sgemm": lambda x, xb, i: F.linear(xb, bf16[i]),
        "bf16 onednn": lambda x, xb, i: torch.ops.mkldnn._linear_pointwise(xb, onednn_bf16[i], None, "none", [], ""),
        "bf16 skinny": lambda x, xb, i: ops.skinny_linear(xb, skinny_bf16[i], n, None),
        "torch int8": lambda x, xb, i: torch.ops.aten._weight_int8pack_mm(x, int8[i], scales[i]),
        "torch int4": lambda x, xb, i: torch.ops.aten._weight_int4pack_mm_for_cpu(x, int4[i][0], 32, int4[i][1]),
        "torch int4 bf16": lambda x, xb, i: torch.ops.aten._weight_int4pack_mm_for_cpu(
            xb, int4_bf16[i][0], 32, int4_bf16[i][1]),
        "raylm Q8_0": lambda x, xb, i: kernels.block_linear(x, q8["f32"][i], Q8_0, None),
        "raylm Q4_1": lambda x, xb, i: kernels.block_linear(x, q4["f32"][i], Q4_1, None),
        # The block kernels as a bfloat16 model's plan calls them (block_quant: x upcast, the result rounded).
        "bf16 raylm Q8_0": lambda x, xb, i: kernels.block_linear(xb.float(), q8["bf16"][i], Q8_0, None).bfloat16(),
        "bf16 raylm Q4_1": lambda x, xb, i: kernels.block_linear(xb.float(), q4["bf16"][i], Q4_1, None).bfloat16(),
        "bf16 int8 Q8_0": lambda x, xb, i: kernels.int8_linear(xb, q8["int8"][i], Q8_0, None, quant_ops),
        "bf16 int8 Q4_1": lambda x, xb, i: kernels.int8_linear(xb, q4["int8"][i], Q4_1, None, quant_ops),
    }
    if not onednn_bf16:
        del calls["bf16 onednn"]
    amx = kernels.amx_kernels_for(torch.device("cpu"), torch.bfloat16)
    if amx is not None:  # AMX tiles over panels decoded to bfloat16 (csrc/quant/amx_gemm.h)
        calls["bf16 amx Q8_0"] = lambda x, xb, i: kernels.amx_linear(xb, q8["amx"][i], Q8_0, None, amx)
        calls["bf16 amx Q4_1"] = lambda x, xb, i: kernels.amx_linear(xb, q4["amx"][i], Q4_1, None, amx)
    dot = kernels.bf16_dot_kernels_for(torch.device("cpu"), torch.bfloat16)
    if dot is not None:  # AVX512-BF16 dot products on blocks decoded to bfloat16 (csrc/quant/bf16_gemm.h)
        calls["bf16 dot Q8_0"] = lambda x, xb, i: kernels.bf16_linear(xb, q8["dot"][i], Q8_0, None, dot)
        calls["bf16 dot Q4_1"] = lambda x, xb, i: kernels.bf16_linear(xb, q4["dot"][i], Q4_1, None, dot)
    if not with_torch:
        calls = {name: call for name, call in calls.items() if "torch" not in name}
    q8_0 = dequantize(q8["f32"][0], Q8_0)
    references = {"torch int8": int8[0].float() * scales[0][:, None], "raylm Q8_0": q8_0, "bf16 raylm Q8_0": q8_0,
                  "bf16 amx Q8_0": q8_0, "bf16 int8 Q8_0": q8_0, "bf16 dot Q8_0": q8_0}
    x = torch.randn(3, k)
    for name, call in calls.items():
        tolerance = 5e-2 if "bf16" in name else 1e-3
        q4_1 = "int4" in name or "Q4_1" in name
        reference = references.get(name, dequantize(q4["f32"][0], Q4_1) if q4_1 else floats[0])
        x_seen = kernels.int8_activations(x.bfloat16()).float() if name.startswith("bf16 int8") else x
        torch.testing.assert_close(call(x, x.bfloat16(), 0).float(), x_seen @ reference.T, rtol=tolerance,
                                   atol=tolerance)
    return calls


def bench(shapes: list[tuple[str, int, int, int]], rows: list[int], rounds: int, with_torch: bool,
          best_round: bool, clock: Callable[[], float]) -> None:
    header = ["layer", "rows"]
    results: list[list[str]] = []
    summed: dict[int, dict[str, float]] = {}
    for layer, n, k, count in shapes:
        copies = max(2, _STREAM_BYTES // (n * k * 4))
        calls = kernels_for_shape(n, k, copies, with_torch)
        header = ["layer", "rows", *[f"{name} (us)" for name in calls], "best"]
        for m in rows:
            x = torch.randn(m, k)
            xb = x.bfloat16()
            times: dict[str, list[float]] = {name: [] for name in calls}
            for _ in range(2):  # warm-up: first calls pack, allocate, fault the copies in
                for call in calls.values():
                    for i in range(copies):
                        call(x, xb, i)
            for r in range(rounds):
                for name, call in calls.items():
                    start = clock()
                    call(x, xb, r % copies)
                    times[name].append(clock() - start)
            medians = {name: (min(t) if best_round else statistics.median(t)) * 1e6 for name, t in times.items()}
            best = min(medians, key=medians.__getitem__)
            results.append([f"{layer} {n}x{k}", str(m), *[f"{medians[name]:.0f}" for name in calls], best])
            # The plan's pick per shape and bucket: the faster of the block kernel and the float kernels on the copy,
            # float32 for float32 activations, bfloat16 for bfloat16 ones. int4 keeps the LM head in Q8_0 (as the
            # default GGUF file does).
            medians["float32 best"] = min(medians["float32"], medians["float32 onednn"], medians["float32 skinny"])
            bf16_best = min(medians["bf16 sgemm"], medians.get("bf16 onednn", float("inf")), medians["bf16 skinny"])
            for method, fmt in (("int8", "Q8_0"), ("int4", "Q8_0" if layer == "lm_head" else "Q4_1")):
                medians[f"{method} blocks"] = medians[f"raylm {fmt}"]
                medians[f"{method} planned"] = min(medians[f"raylm {fmt}"], medians["float32 best"])
                blocks_bf16 = min(medians[f"bf16 raylm {fmt}"], medians.get(f"bf16 amx {fmt}", float("inf")),
                                  medians.get(f"bf16 dot {fmt}", float("inf")))
                medians[f"{method} planned bf16 no int8"] = min(blocks_bf16, bf16_best)
                medians[f"{method} int8"] = medians[f"bf16 int8 {fmt}"]
                medians[f"{method} planned bf16"] = min(medians[f"{method} planned bf16 no int8"],
                                                        medians[f"{method} int8"])
                medians[f"{method} blocks bf16"] = min(blocks_bf16, medians[f"{method} int8"])
            summed.setdefault(m, {name: 0.0 for name in medians})
            for name, value in medians.items():
                summed[m][name] += value * count
            print(" | ".join(results[-1]), file=sys.stderr, flush=True)
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in results:
        print("| " + " | ".join(row) + " |")
    summary(summed)


def summary(summed: dict[int, dict[str, float]]) -> None:
    """Per batch, one forward's linears summed (each shape times its layers in the model): float32's best kernel,
    and each method's speed against it (int8: Q8_0; int4 and the default GGUF: Q4_1, the LM head Q8_0): the block
    kernel alone, planned in float32, the int8-activation kernel alone (bfloat16 x), planned in bfloat16 without and
    with it, and the block kernels alone in bfloat16."""
    columns = ["int8 blocks", "int4 blocks", "int8 planned", "int4 planned", "int8 int8", "int4 int8",
               "int8 planned bf16 no int8", "int4 planned bf16 no int8", "int8 planned bf16", "int4 planned bf16",
               "int8 blocks bf16", "int4 blocks bf16"]
    print("\n| rows | float32 best (ms) | int8 blocks | int4 blocks | int8 planned, float32 | int4 planned, float32 "
          "| int8 on int8 x | int4 on int8 x | int8 planned, bfloat16, without int8 x "
          "| int4 planned, bfloat16, without int8 x | int8 planned, bfloat16 | int4 planned, bfloat16 "
          "| int8 blocks only, bfloat16 | int4 blocks only, bfloat16 |")
    print("|" + "---|" * (2 + len(columns)))
    for m, t in summed.items():
        best = t["float32 best"]
        print(f"| {m} | {best / 1e3:.1f} | " + " | ".join(f"{best / t[name]:.2f}x" for name in columns) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", choices=SHAPES, default="smollm2")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--no-torch", action="store_true", help="leave out torch's own weight-only ops")
    parser.add_argument("--best", action="store_true", help="the fastest round of each kernel, not the median")
    parser.add_argument("--cpu-time", action="store_true", help="one thread, each call's CPU time (time.thread_time)")
    args = parser.parse_args()
    if args.cpu_time:
        torch.set_num_threads(1)
    assert kernels.load() is not None, "raylm's quantized kernels did not build"
    before = machine_line()
    print(before, file=sys.stderr)
    bench(SHAPES[args.shapes], args.rows, args.rounds, not args.no_torch, args.best,
          time.thread_time if args.cpu_time else time.perf_counter)
    statistic = "best" if args.best else "median"
    clock = "CPU time" if args.cpu_time else "wall time"
    print(f"\n{torch.get_num_threads()} threads, {statistic} of {args.rounds} interleaved calls ({clock}), weights "
          f"streamed from memory (copies past the caches)\nbefore: {before}\nafter:  {machine_line()}")


if __name__ == "__main__":
    main()
