"""GPU checks in one command (< 8 min on one GPU): backends token-exact, decode step time eager vs CUDA graphs,
offline throughput against transformers, weight-read bandwidth at batch 1, sleep / wake-up. Each section records its
error in the table and the script goes on; one table at the end (and as JSON with --output-json).

    python scripts/gpu_check.py [--output-json gpu_check.json]
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import itertools
import json
import random
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster import LLM  # noqa: E402
from cluster.tiny_model import make_tiny_model  # noqa: E402
from runner.sampling_params import SamplingParams  # noqa: E402

Row = dict[str, Any]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
_ids = itertools.count()


def add(rows: list[Row], section: str, metric: str, value: Any, target: str = "", ok: bool | None = None) -> None:
    rows.append({"section": section, "metric": metric, "value": value, "target": target, "ok": ok})


def run_section(rows: list[Row], section: str, fn: Callable[[list[Row]], None]) -> None:
    start = time.perf_counter()
    try:
        fn(rows)
    except Exception as err:  # noqa: BLE001 - a failing section is recorded, the others still run
        traceback.print_exc()
        add(rows, section, "error", f"{type(err).__name__}: {err}"[:300], ok=False)
    print(f"[gpu_check] {section}: {time.perf_counter() - start:.1f} s", flush=True)


def free_cuda() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def make_llm(model: Path, **settings: Any) -> LLM:
    settings = {"disable_log_stats": True, "gpu_memory_utilization": 0.4, **settings}
    return LLM(model=str(model), **settings)


def close(llm: LLM) -> None:
    llm.shutdown()  # the in-process executor drops its model runner (weights, KV cache, graphs)
    free_cuda()


def prompts(n: int, low: int, high: int, vocab: int, seed: int = 0) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(rng.randint(low, high))]} for _ in range(n)]


def greedy_tokens(model: Path, batch: list[dict[str, list[int]]], **settings: Any) -> list[list[int]]:
    llm = make_llm(model, **settings)
    try:
        return [out.outputs[0].token_ids for out in llm.generate(batch, GREEDY, use_tqdm=False)]
    finally:
        close(llm)


def decode_ms(llm: LLM, batch: int, steps: int = 64, warmup: int = 8) -> float:
    """Mean ms per decode step of `batch` running requests (8-token prompts), prefill excluded."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=steps + warmup + 8, ignore_eos=True)
    ids = [f"decode-{next(_ids)}" for _ in range(batch)]
    for rid, prompt in zip(ids, prompts(batch, 8, 8, 2000, seed=batch)):
        engine.add_request(rid, prompt, params, output_kind="final")
    for _ in range(warmup):  # the prefill (one step at <= 2048 tokens) and a few decodes
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed / steps * 1e3


def build_qwen_05b(out: Path, tiny: Path) -> Path:
    """A random Qwen2-0.5B-shaped checkpoint in bf16, with the tiny model's (smaller) tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    if (out / "model.safetensors").is_file():
        return out
    config = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096,
                         tie_word_embeddings=True, dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny / name).is_file():
            shutil.copy(tiny / name, out / name)
    del model
    free_cuda()
    return out


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of a 1 GiB tensor: bytes read + written per second, in GB/s."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del src, dst
    free_cuda()
    return 2 * (1 << 30) * 20 / seconds / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-json", type=Path, default=None)
    parser.add_argument("--workdir", type=Path, default=None, help="where the checkpoints go (default: a temp dir)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing to check.", file=sys.stderr)
        return 2

    work = args.workdir or Path(tempfile.mkdtemp(prefix="raylm-gpu-check-"))
    tiny = make_tiny_model(work / "tiny-llama", arch="llama", hidden_size=256, num_layers=4, num_heads=4,
                           num_kv_heads=2, intermediate_size=768, max_position_embeddings=1024)
    qwen = work / "qwen2-0.5b-random"
    rows: list[Row] = []
    state: dict[str, Any] = {}

    def backends(rows: list[Row]) -> None:
        batch = prompts(8, 5, 60, 2000)
        base = {"max_model_len": 512}
        ref32 = greedy_tokens(tiny, batch, attention_backend="torch", enforce_eager=True, dtype="float32", **base)
        cases: list[tuple[str, list[list[int]], dict[str, Any]]] = [
            ("torch graphs (default cudagraph_mode) vs eager, fp32", ref32,
             {"attention_backend": "torch", "dtype": "float32"})]
        try:
            import triton  # noqa: F401
            cases += [(f"triton{' graphs' if not eager else ''} vs torch eager, fp32", ref32,
                       {"attention_backend": "triton", "enforce_eager": eager, "dtype": "float32"})
                      for eager in (True, False)]
        except ImportError:
            add(rows, "1 backends", "triton", "not installed (skipped)")
        try:
            import flash_attn  # noqa: F401
            ref16 = greedy_tokens(tiny, batch, attention_backend="torch", enforce_eager=True, dtype="bfloat16",
                                  block_size=256, **base)
            cases.append(("flash_attn vs torch eager, bf16, block 256", ref16,
                          {"attention_backend": "flash_attn", "dtype": "bfloat16", "block_size": 256}))
        except ImportError:
            add(rows, "1 backends", "flash_attn", "not installed (skipped)")
        for name, ref, settings in cases:
            try:
                got = greedy_tokens(tiny, batch, **base, **settings)
                same = sum(a == b for a, b in zip(got, ref))
                add(rows, "1 backends", name, f"{same}/{len(ref)} prompts identical", "all", same == len(ref))
            except Exception as err:  # noqa: BLE001
                traceback.print_exc()
                add(rows, "1 backends", name, f"{type(err).__name__}: {err}"[:300], "all", False)

    def decode_steps(rows: list[Row]) -> None:
        for backend in ("torch", "triton") if importlib.util.find_spec("triton") else ("torch",):
            times: dict[str, dict[int, float]] = {}
            for mode, eager in (("eager", True), ("graphs", False)):
                llm = make_llm(tiny, attention_backend=backend, enforce_eager=eager, dtype="float32",
                               max_model_len=256, max_num_seqs=256)
                try:
                    times[mode] = {b: decode_ms(llm, b) for b in (1, 8, 64, 256)}
                finally:
                    close(llm)
            for b in (1, 8, 64, 256):
                add(rows, "2 decode step", f"{backend}, batch {b}: eager / graphs ms",
                    f"{times['eager'][b]:.3f} / {times['graphs'][b]:.3f}")
            speedup = times["eager"][1] / times["graphs"][1]
            add(rows, "2 decode step", f"{backend}: graphs speed-up at batch 1", f"{speedup:.2f}x", ">= 2x",
                speedup >= 2.0)

    def throughput(rows: list[Row]) -> None:
        from transformers import AutoModelForCausalLM
        build_qwen_05b(qwen, tiny)
        batch = prompts(64, 128, 512, 151000, seed=1)
        params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
        llm = make_llm(qwen, attention_backend="torch", dtype="bfloat16", max_model_len=1024, max_num_seqs=64,
                       gpu_memory_utilization=0.5)
        try:
            llm.generate(batch[:4], params, use_tqdm=False)  # warm-up
            start = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            raylm_tps = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
            state["decode_ms_b1"] = decode_ms(llm, 1)
        finally:
            close(llm)
        model = AutoModelForCausalLM.from_pretrained(qwen, dtype=torch.bfloat16).cuda().eval()
        state["weight_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        longest = max(len(p["prompt_token_ids"]) for p in batch)
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(batch):
            toks = p["prompt_token_ids"]
            ids[i, longest - len(toks):] = torch.tensor(toks)
            mask[i, longest - len(toks):] = 1
        ids, mask = ids.cuda(), mask.cuda()
        gen = {"max_new_tokens": 128, "min_new_tokens": 128, "do_sample": False, "pad_token_id": 0}
        with torch.inference_mode():
            model.generate(input_ids=ids[:4, -64:], attention_mask=mask[:4, -64:], **{**gen, "max_new_tokens": 8,
                                                                                     "min_new_tokens": 8})
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=mask, **gen)
            torch.cuda.synchronize()
        hf_tps = (out.shape[1] - longest) * len(batch) / (time.perf_counter() - start)
        del model, out
        free_cuda()
        ratio = raylm_tps / hf_tps
        add(rows, "3 throughput", "raylm / transformers output tok/s", f"{raylm_tps:.0f} / {hf_tps:.0f}")
        add(rows, "3 throughput", "raylm / transformers", f"{ratio:.2f}x", ">= 3x", ratio >= 3.0)

    def bandwidth(rows: list[Row]) -> None:
        if "weight_bytes" not in state or "decode_ms_b1" not in state:
            raise RuntimeError("needs section 3's 0.5B model and its batch-1 decode time")
        gbs = copy_bandwidth_gbs()
        roofline_ms = state["weight_bytes"] / (gbs * 1e9) * 1e3
        fraction = roofline_ms / state["decode_ms_b1"]
        add(rows, "4 bandwidth", "copy GB/s; weights GB", f"{gbs:.0f}; {state['weight_bytes'] / 1e9:.3f}")
        add(rows, "4 bandwidth", "decode ms at batch 1 / roofline ms",
            f"{state['decode_ms_b1']:.3f} / {roofline_ms:.3f}")
        add(rows, "4 bandwidth", "fraction of roofline", f"{fraction:.0%}", ">= 60%", fraction >= 0.6)

    def sleep_wake(rows: list[Row]) -> None:
        batch = prompts(4, 5, 40, 2000, seed=2)
        llm = make_llm(tiny, attention_backend="torch", dtype="float32", max_model_len=512)
        try:
            before = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]
            free_cuda()
            alloc0, free0 = torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]
            llm.sleep(level=1)
            free_cuda()
            alloc1, free1 = torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]
            llm.wake_up()
            free_cuda()
            alloc2, free2 = torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]
            after = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]
        finally:
            close(llm)
        gib = 1 << 30
        add(rows, "5 sleep", "freed by sleep GiB (allocated; device free)",
            f"{(alloc0 - alloc1) / gib:.2f}; {(free1 - free0) / gib:.2f}", "> 1 GiB", free1 - free0 > gib)
        add(rows, "5 sleep", "restored by wake_up GiB (allocated; device)",
            f"{(alloc2 - alloc1) / gib:.2f}; {(free1 - free2) / gib:.2f}", "~ freed",
            abs((free1 - free2) - (free1 - free0)) < 0.1 * (free1 - free0) + 0.25 * gib)
        add(rows, "5 sleep", "output after wake_up", "identical" if after == before else "DIFFERENT", "identical",
            after == before)

    for section, fn in (("1 backends", backends), ("2 decode step", decode_steps), ("3 throughput", throughput),
                        ("4 bandwidth", bandwidth), ("5 sleep", sleep_wake)):
        run_section(rows, section, fn)

    device = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    keys = ("section", "metric", "value", "target")
    table = [{**{k: k for k in keys}, "ok": "ok"}, *rows]
    widths = [max(len(str(r[k])) for r in table) for k in keys]
    print(f"\ngpu_check on {device}")
    for r in table:
        ok = {True: "PASS", False: "FAIL", None: ""}.get(r["ok"], r["ok"])
        print(" | ".join(str(r[k]).ljust(w) for k, w in zip(keys, widths)), "|", ok)
    if args.output_json:
        args.output_json.write_text(json.dumps({"device": device, "rows": rows}, indent=2))
    return 1 if any(r["ok"] is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
