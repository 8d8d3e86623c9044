"""GPU checks in one command (within --budget-s, 300 s by default, on one GPU): backends token-exact, decode step time
eager vs CUDA graphs with the graphs proven (every capture size captured once, every timed step replayed, none eager)
and the steps run under sync-debug mode "error", offline throughput against transformers, weight-read bandwidth at
batch 1, sleep / wake-up, the sampler's paths without a host wait, and the Triton kernel on quantized blocks against
dequantize-then-matmul. Each section records its error in the table and the script goes on; one table at the end,
each row naming the attention backend, dtype, graph mode and sync-debug result it ran with (and as JSON with
--output-json, with every timed step's graph key).

    python scripts/gpu_check.py [--output-json gpu_check.json] [--sections 1 3] [--budget-s 300]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raylm.cluster.models.tiny_model import make_tiny_model  # noqa: E402
from raylm.common.sampling_params import SamplingParams  # noqa: E402
from raylm.runner.attention import choose_attn_backend  # noqa: E402
from scripts.bench_common import vocab_size  # noqa: E402
from scripts.gpu_measure import (  # noqa: E402
    Row,
    add,
    block_gemm_rows,
    build_random_qwen,
    close,
    compare_greedy,
    copy_bandwidth_gbs,
    decode_ms,
    format_table,
    free_memory,
    greedy_outputs,
    greedy_tokens,
    make_llm,
    prompts,
    replay_ms,
    transformers_generate,
)
from scripts.gpu_proof import (  # noqa: E402
    SYNC_CASES,
    check_captures,
    check_replays,
    graph_report,
    greedy_tokens_and_replays,
    keys_summary,
    sync_debug_decode,
    timed_decode,
)

DECODE_BATCHES = (1, 8, 64, 256)
# flash-attn runs 16-bit with pages of 256 tokens; the other backends are checked in float32 (exact comparisons).
FLASH = {"attention_backend": "flash_attn", "dtype": "bfloat16", "block_size": 256}


@dataclass
class GpuCheck:
    tiny: Path  # a 4-layer llama for exactness and step times
    moe: Path  # a 2-layer Mixtral (8 experts, top-2) for the experts' grouped matmul inside graphs
    qwen: Path  # where the random Qwen2-0.5B-shaped checkpoint goes
    rows: list[Row] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)  # section 3's figures for section 4
    runs: list[dict[str, Any]] = field(default_factory=list)  # section 2's graph report and step keys per engine


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def moe_settings() -> dict[str, Any]:
    """The Mixtral's: bfloat16 (the experts' one-kernel grouped matmul), and triton attention where installed, whose
    eager and captured decodes are one kernel. The torch backend's are not (SDPA eager, a float32 packed decode in
    graphs): 1-ulp differences that flip the router's top-2 now and then, and with it a token's whole expert output."""
    return {"attention_backend": "triton" if installed("triton") else "torch", "dtype": "bfloat16"}


def graphs_are_captured() -> bool:
    """Whether this machine captures CUDA graphs at all (on CPU a "graphs" run is eager)."""
    return torch.cuda.is_available()


def check_backends(check: GpuCheck) -> None:
    """Greedy tokens of 8 prompts from every backend, eager and with graphs, against the torch backend eager. A
    "graphs" row passes only if graphs were replayed: on a machine where nothing is captured it says so and proves
    nothing."""
    batch, base = prompts(8, 5, 60, vocab_size(check.tiny)), {"max_model_len": 512}
    ref32 = greedy_tokens(check.tiny, batch, attention_backend="torch", enforce_eager=True, dtype="float32", **base)
    cases: list[tuple[str, Path, list[list[int]], dict[str, Any]]] = [
        ("torch graphs vs torch eager, fp32", check.tiny, ref32, {"attention_backend": "torch", "dtype": "float32"})]
    if installed("triton"):
        cases += [(f"triton {mode} vs torch eager, fp32", check.tiny, ref32,
                   {"attention_backend": "triton", "enforce_eager": mode == "eager", "dtype": "float32"})
                  for mode in ("eager", "graphs")]
    else:
        add(check.rows, "1 backends", "triton", "not installed (skipped)")
    if installed("flash_attn"):
        ref16 = greedy_tokens(check.tiny, batch, **{**FLASH, "attention_backend": "torch"}, enforce_eager=True,
                              **base)
        cases += [(f"flash_attn {mode} vs torch eager, bf16, block 256", check.tiny, ref16,
                   {**FLASH, "enforce_eager": mode == "eager"}) for mode in ("eager", "graphs")]
    else:
        add(check.rows, "1 backends", "flash_attn", "not installed (skipped)")
    moe = moe_settings()
    moe_eager = greedy_tokens(check.moe, batch, **moe, enforce_eager=True, **base)
    cases.append(("mixtral graphs vs eager, bf16 (grouped matmul)", check.moe, moe_eager, moe))
    for name, model, ref, settings in cases:
        case = dict(backend=settings["attention_backend"], dtype=settings["dtype"],
                    graphs="NONE" if settings.get("enforce_eager") else "FULL")
        try:
            got, replays = greedy_tokens_and_replays(model, batch, **base, **settings)
            value, ok = compare_greedy(got, ref, exact=settings["dtype"] == "float32")
            if case["graphs"] == "FULL":
                value += f", {replays} forwards replayed a graph"
                ok = ok and replays > 0 if graphs_are_captured() else None  # no CUDA: no graph, no proof
            add(check.rows, "1 backends", name, value, "all", ok, **case)
        except Exception as err:  # noqa: BLE001 - one failing backend, the others still run
            traceback.print_exc()
            add(check.rows, "1 backends", name, f"{type(err).__name__}: {err}"[:300], "all", False, **case)


def check_decode_steps(check: GpuCheck) -> None:
    """ms per decode step at each batch size, eager and with graphs, for every installed backend; proven, not assumed:
    with graphs every capture size was captured once and every timed step replayed (its graph key says so), eager
    none did, and a few decode steps of each engine ran under sync-debug mode "error"."""
    backends = [("torch", check.tiny, {"attention_backend": "torch", "dtype": "float32"})]
    if installed("triton"):
        backends.append(("triton", check.tiny, {"attention_backend": "triton", "dtype": "float32"}))
    if installed("flash_attn"):
        backends.append(("flash_attn", check.tiny, FLASH))
    moe = moe_settings()
    backends.append((f"mixtral ({moe['attention_backend']} attention)", check.moe, moe))
    for name, model, settings in backends:
        times: dict[str, dict[int, float]] = {}
        for mode in ("eager", "graphs"):
            llm = make_llm(model, enforce_eager=mode == "eager", max_model_len=256,
                           max_num_seqs=max(DECODE_BATCHES), **settings)
            try:
                runs = [timed_decode(llm, b) for b in DECODE_BATCHES]
                sync = sync_debug_decode(llm, SYNC_CASES["greedy"])
                report = graph_report(llm)
            finally:
                close(llm)
            graphs = mode == "graphs"
            case = dict(backend=name, dtype=settings["dtype"], graphs="FULL" if graphs else "NONE", sync=sync)
            check.runs.append({**case, "capture_sizes": report["capture_sizes"], "captured": report["captured"],
                               "replayed": report["replayed"],
                               "steps": {run.batch: keys_summary(run.forwards) for run in runs}})
            if graphs:
                add(check.rows, "2 decode step", "graphs captured", *check_captures(report), **case)
            for run in runs:
                value, ok = check_replays(run, graphs)
                add(check.rows, "2 decode step", f"batch {run.batch}", value,
                    "every step replayed" if graphs else "no replay", ok, **case)
            add(check.rows, "2 decode step", "4 greedy decode steps of 8 under sync-debug 'error'", sync, "none",
                sync == "none", **case)
            times[mode] = {run.batch: run.ms for run in runs}
        speedup = times["eager"][1] / times["graphs"][1]
        add(check.rows, "2 decode step", "graphs speed-up at batch 1", f"{speedup:.2f}x", ">= 2x", speedup >= 2.0,
            backend=name, dtype=settings["dtype"], graphs="FULL vs NONE")


def check_throughput(check: GpuCheck) -> None:
    """64 prompts of 128-512 tokens, 128 output tokens each, through the default backend and transformers."""
    build_random_qwen(check.qwen, check.tiny)
    batch = prompts(64, 128, 512, vocab_size(check.qwen), seed=1)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    block_size = FLASH["block_size"] if installed("flash_attn") else 16  # what lets `auto` pick flash_attn
    backend = choose_attn_backend("auto", "cuda", torch.bfloat16, block_size)
    llm = make_llm(check.qwen, dtype="bfloat16", block_size=block_size, max_model_len=1024, max_num_seqs=64,
                   gpu_memory_utilization=0.5)
    try:
        llm.generate(batch[:4], params, use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        raylm_tps = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
        check.state["decode_ms_b1"] = decode_ms(llm, 1)
        check.state["replay_ms_b1"] = replay_ms(llm, 1)
    finally:
        close(llm)
    hf_tps, check.state["weight_bytes"] = transformers_generate(check.qwen, batch, 128)
    ratio = raylm_tps / hf_tps
    case = check.state["case"] = dict(backend=backend, dtype="bfloat16", graphs="FULL")
    add(check.rows, "3 throughput", "raylm / transformers output tok/s", f"{raylm_tps:.0f} / {hf_tps:.0f}", **case)
    add(check.rows, "3 throughput", "raylm / transformers", f"{ratio:.2f}x", ">= 3x", ratio >= 3.0, **case)


def check_bandwidth(check: GpuCheck) -> None:
    """Section 3's batch-1 decode step against the time to read its weights once at the measured copy bandwidth."""
    if any(key not in check.state for key in ("weight_bytes", "decode_ms_b1", "replay_ms_b1")):
        raise RuntimeError("needs section 3's 0.5B model and its batch-1 decode time")
    gbs = copy_bandwidth_gbs()
    roofline_ms = check.state["weight_bytes"] / (gbs * 1e9) * 1e3
    step_ms, replay = check.state["decode_ms_b1"], check.state["replay_ms_b1"]
    case = check.state["case"]
    add(check.rows, "4 bandwidth", "copy GB/s; weights GB", f"{gbs:.0f}; {check.state['weight_bytes'] / 1e9:.3f}")
    add(check.rows, "4 bandwidth", "step ms / graph replay ms / roofline ms, batch 1",
        f"{step_ms:.3f} / {replay:.3f} / {roofline_ms:.3f}", **case)
    add(check.rows, "4 bandwidth", "the step's host share (not in the graph)", f"{1 - replay / step_ms:.0%}", **case)
    add(check.rows, "4 bandwidth", "graph replay: fraction of roofline", f"{roofline_ms / replay:.0%}", ">= 60%",
        roofline_ms / replay >= 0.6, **case)


def check_sleep(check: GpuCheck) -> None:
    """Device memory freed by sleep(level=1) and taken again by wake_up(), and the output after it."""
    batch = prompts(4, 5, 40, vocab_size(check.tiny), seed=2)
    llm = make_llm(check.tiny, attention_backend="torch", dtype="float32", max_model_len=512)
    try:
        before = greedy_outputs(llm, batch)
        memory = []
        for change in (lambda: None, lambda: llm.sleep(level=1), llm.wake_up):
            change()
            free_memory()
            memory.append((torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]))
        after = greedy_outputs(llm, batch)
    finally:
        close(llm)
    (alloc0, free0), (alloc1, free1), (alloc2, free2) = memory
    gib = 1 << 30
    case = dict(backend="torch", dtype="float32", graphs="FULL")
    add(check.rows, "5 sleep", "freed by sleep GiB (allocated; device free)",
        f"{(alloc0 - alloc1) / gib:.2f}; {(free1 - free0) / gib:.2f}", "> 1 GiB", free1 - free0 > gib, **case)
    add(check.rows, "5 sleep", "restored by wake_up GiB (allocated; device)",
        f"{(alloc2 - alloc1) / gib:.2f}; {(free1 - free2) / gib:.2f}", "~ freed",
        abs((free1 - free2) - (free1 - free0)) < 0.1 * (free1 - free0) + 0.25 * gib, **case)
    add(check.rows, "5 sleep", "output after wake_up", "identical" if after == before else "DIFFERENT", "identical",
        after == before, **case)


def check_sync_free_sampling(check: GpuCheck) -> None:
    """The sampler's paths (greedy, top-k / top-p / min-p, mixed greedy and random rows, penalties, logprobs), each
    in decode steps under sync-debug mode "error", with graphs."""
    case = dict(backend="torch", dtype="float32", graphs="FULL")
    llm = make_llm(check.tiny, attention_backend="torch", dtype="float32", max_model_len=256, max_num_seqs=16)
    try:
        for name, params in SYNC_CASES.items():
            sync = sync_debug_decode(llm, params)
            add(check.rows, "6 sampling sync", name, sync, "none", sync == "none", **{**case, "sync": sync})
    finally:
        close(llm)


SECTIONS: list[tuple[str, Callable[[GpuCheck], None]]] = [
    ("1 backends", check_backends), ("2 decode step", check_decode_steps), ("3 throughput", check_throughput),
    ("4 bandwidth", check_bandwidth), ("5 sleep", check_sleep), ("6 sampling sync", check_sync_free_sampling),
    ("7 quant kernel", lambda check: block_gemm_rows(check.rows, "7 quant kernel"))]


def run_section(check: GpuCheck, section: str, fn: Callable[[GpuCheck], None]) -> None:
    start = time.perf_counter()
    try:
        fn(check)
    except Exception as err:  # noqa: BLE001 - a failing section is recorded, the others still run
        traceback.print_exc()
        add(check.rows, section, "error", f"{type(err).__name__}: {err}"[:300], ok=False)
    print(f"[gpu_check] {section}: {time.perf_counter() - start:.1f} s", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-json", type=Path, default=None)
    parser.add_argument("--workdir", type=Path, default=None, help="where the checkpoints go (default: a temp dir)")
    parser.add_argument("--sections", type=int, nargs="+", choices=range(1, len(SECTIONS) + 1),
                        default=list(range(1, len(SECTIONS) + 1)),
                        help="which sections to run (default: all; 4 needs 3), e.g. to rerun only the failed ones")
    parser.add_argument("--budget-s", type=float, default=300.0,
                        help="a section that would start past this many seconds is skipped (a failed row)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing to check.", file=sys.stderr)
        return 2
    start = time.perf_counter()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="raylm-gpu-check-"))
    tiny = make_tiny_model(work / "tiny-llama", arch="llama", hidden_size=256, num_layers=4, num_heads=4,
                           num_kv_heads=2, intermediate_size=768, max_position_embeddings=1024)
    moe = make_tiny_model(work / "tiny-mixtral", arch="mixtral", hidden_size=256, num_layers=2, num_heads=4,
                          num_kv_heads=2, intermediate_size=512, num_experts=8, num_experts_per_tok=2,
                          max_position_embeddings=1024)
    check = GpuCheck(tiny, moe, work / "qwen2-0.5b-random")
    for number in sorted(set(args.sections)):
        section, fn = SECTIONS[number - 1]
        if time.perf_counter() - start > args.budget_s:
            add(check.rows, section, "skipped", f"past the {args.budget_s:.0f} s budget", ok=False)
            continue
        run_section(check, section, fn)
    device = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    print(f"\ngpu_check on {device} in {time.perf_counter() - start:.0f} s\n{format_table(check.rows)}")
    if args.output_json:
        args.output_json.write_text(json.dumps({"device": device, "rows": check.rows, "runs": check.runs}, indent=2))
    return 1 if any(r["ok"] is False for r in check.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
