"""What scripts/gpu_check.py measures with: engines built and closed, greedy tokens, decode step time, a random
Qwen2-shaped checkpoint, transformers' `generate` throughput, copy bandwidth, the Triton kernel on quantized blocks,
the result table. Everything but the copy bandwidth runs on CPU too (the block kernel in Triton's interpreter), which
is how tests/test_gpu_check.py and tests/test_triton_block_gemm.py keep the script from rotting between GPU runs."""
from __future__ import annotations

import gc
import itertools
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from raylm.cluster import LLM
from raylm.common.sampling_params import SamplingParams
from raylm.runner.layers.quantization.ggml_blocks import FORMATS, BlockFormat, dequantize, quantize

Row = dict[str, Any]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)  # top-5: where 16-bit runs diverge
Greedy = tuple[list[int], list[dict[int, float]]]  # one prompt's greedy tokens, and the top-5 logprobs at each
_ids = itertools.count()


CASE_COLUMNS = ("backend", "dtype", "graphs", "sync")
QUANT_LAYERS = {"qkv 6144x4096": (6144, 4096), "down 4096x14336": (4096, 14336)}  # Llama-3-8B's (N, K)
QUANT_BATCHES = (1, 8, 64)


def add(rows: list[Row], section: str, metric: str, value: Any, target: str = "", ok: bool | None = None,
        **case: str) -> None:
    """One result row; `case` names what it ran on (CASE_COLUMNS: attention backend, dtype, CUDA-graph mode,
    sync-debug result; "-" where a row has none)."""
    unknown = set(case) - set(CASE_COLUMNS)
    assert not unknown, f"unknown row columns {unknown}"
    rows.append({"section": section, "metric": metric, **{k: case.get(k, "-") for k in CASE_COLUMNS},
                 "value": value, "target": target, "ok": ok})


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def make_llm(model: Path, **settings: Any) -> LLM:
    settings = {"disable_log_stats": True, "gpu_memory_utilization": 0.4, "record_forwards": True, **settings}
    return LLM(model=str(model), **settings)


def close(llm: LLM) -> None:
    llm.shutdown()  # the in-process executor drops its model runner (weights, KV cache, graphs)
    free_memory()


def prompts(n: int, low: int, high: int, vocab: int, seed: int = 0) -> list[dict[str, list[int]]]:
    """n prompts of low..high random token ids below `vocab` (the first ten left out: special tokens)."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(rng.randint(low, high))]} for _ in range(n)]


def greedy_outputs(llm: LLM, batch: list[dict[str, list[int]]]) -> list[Greedy]:
    outputs = [out.outputs[0] for out in llm.generate(batch, GREEDY, use_tqdm=False)]
    return [(list(out.token_ids), out.logprobs or []) for out in outputs]


def greedy_tokens(model: Path, batch: list[dict[str, list[int]]], **settings: Any) -> list[Greedy]:
    llm = make_llm(model, **settings)
    try:
        return greedy_outputs(llm, batch)
    finally:
        close(llm)


def compare_greedy(got: list[Greedy], ref: list[Greedy], exact: bool, tie: float = 0.02) -> tuple[str, bool]:
    """How many prompts' greedy tokens are identical, and whether that passes: all of them, or (exact False, for
    16-bit runs, whose kernels round differently) the others part at a near-tie: where they first differ, both
    tokens are in each side's top-5, within `tie` of each other in logprob."""
    same = sum(ours == theirs for (ours, _), (theirs, _) in zip(got, ref))
    near_ties = 0
    for (ours, our_top), (theirs, their_top) in zip(got, ref):
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if first is not None and all(ours[first] in top[first] and theirs[first] in top[first]
                                     and abs(top[first][ours[first]] - top[first][theirs[first]]) <= tie
                                     for top in (our_top, their_top)):
            near_ties += 1
    value = f"{same}/{len(ref)} prompts identical" + (f", {near_ties} diverged at a near-tie" if near_ties else "")
    return value, same == len(ref) or (not exact and same + near_ties == len(ref))


def decode_ms(llm: LLM, batch: int, steps: int = 64, warmup: int = 8,
              timed: Callable[[], Any] | None = None) -> float:
    """Mean ms per decode step of `batch` running requests (8-token prompts), prefill excluded. `timed`, when given,
    is called right before and right after the timed steps (not timed itself)."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=steps + warmup + 8, ignore_eos=True)
    ids = [f"decode-{next(_ids)}" for _ in range(batch)]
    for rid, prompt in zip(ids, prompts(batch, 8, 8, engine.model_info.vocab_size, seed=batch)):
        engine.add_request(rid, prompt, params, output_kind="final")
    for _ in range(warmup):  # the prefill (one step at <= 2048 tokens) and a few decodes
        engine.step()
    synchronize()
    if timed is not None:
        timed()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    synchronize()
    elapsed = time.perf_counter() - start
    if timed is not None:
        timed()
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed / steps * 1e3


def replay_ms(llm: LLM, num_tokens: int, replays: int = 50) -> float:
    """Device ms of one replay of the in-process runner's FULL graph of `num_tokens`, on what its buffers hold: the
    forward alone, without the step's scheduling, input preparation and sampling (decode_ms times all of it)."""
    runner = llm.llm_engine.engine_core.executor.worker.model_runner  # the uniproc executor's one worker
    assert runner.graphs is not None and runner.graphs.runner is not None, "no FULL graphs were captured"
    graph = runner.graphs.runner.graphs[num_tokens]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def build_random_qwen(out: Path, tokenizer_from: Path, device: str = "cuda", **shape: int) -> Path:
    """A random Qwen2-0.5B-shaped checkpoint in bf16 (`shape` overrides its sizes), with `tokenizer_from`'s (smaller)
    tokenizer; kept when `out` already holds one."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    if (out / "model.safetensors").is_file():
        return out
    sizes = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "vocab_size": 151936, **shape}
    config = Qwen2Config(**sizes, max_position_embeddings=4096, tie_word_embeddings=True, dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, out / name)
    del model
    free_memory()
    return out


def transformers_generate(model_path: Path, batch: list[dict[str, list[int]]], max_new_tokens: int,
                          device: str = "cuda") -> tuple[float, int]:
    """transformers' greedy `generate` of the whole batch at once (left-padded, `max_new_tokens` each): output
    tokens/s, and the model's weight bytes."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).to(device).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    longest = max(len(p["prompt_token_ids"]) for p in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):
        tokens = p["prompt_token_ids"]
        ids[i, longest - len(tokens):] = torch.tensor(tokens)
        mask[i, longest - len(tokens):] = 1
    ids, mask = ids.to(device), mask.to(device)
    settings = {"do_sample": False, "pad_token_id": 0}
    with torch.inference_mode():
        warm = min(8, longest)
        model.generate(input_ids=ids[:4, -warm:], attention_mask=mask[:4, -warm:], max_new_tokens=4,
                       min_new_tokens=4, **settings)
        synchronize()
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, **settings)
        synchronize()
    tokens_per_s = (out.shape[1] - longest) * len(batch) / (time.perf_counter() - start)
    del model, out
    free_memory()
    return tokens_per_s, weight_bytes


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
    free_memory()
    return 2 * (1 << 30) * 20 / seconds / 1e9


def device_ms(fn: Callable[[], Any]) -> float:
    """ms per call of `fn`: on CUDA Triton's do_bench (device time, the L2 cache flushed before each call, as a
    decode step finds a layer's weights); elsewhere the host's clock over a few calls."""
    if torch.cuda.is_available():
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=5, rep=30))
    fn()
    start = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - start) / 3 * 1e3


def block_gemm_run(fmt: BlockFormat, n: int, k: int, m: int, device: str = "cuda") -> tuple[float, float, float]:
    """The Triton kernel on a random W [n, k] in `fmt` against dequantize-then-matmul (the per-call path it
    replaced), x [m, k] bfloat16: (kernel ms, dequantize-then-matmul ms, largest |difference| / largest |y|)."""
    from raylm.runner.layers.quantization import triton_block_gemm
    generator = torch.Generator(device).manual_seed(m)
    packed = quantize(torch.randn(n, k, generator=generator, device=device) * 0.02, fmt)
    x = torch.randn(m, k, generator=generator, device=device).to(torch.bfloat16)
    kernel = lambda: triton_block_gemm.block_linear(x, packed, fmt, None)  # noqa: E731
    per_call = lambda: torch.nn.functional.linear(x, dequantize(packed, fmt).to(x.dtype))  # noqa: E731
    ours, reference = kernel().float(), per_call().float()
    error = float((ours - reference).abs().max() / reference.abs().max())
    return device_ms(kernel), device_ms(per_call), error


def block_gemm_rows(rows: list[Row], section: str, device: str = "cuda",
                    layers: dict[str, tuple[int, int]] = QUANT_LAYERS) -> None:
    """The Triton kernel on ggml blocks (what quantized layers run on CUDA) against dequantize-then-matmul, the
    per-call float copy it replaced: ms at each batch of QUANT_BATCHES on `layers`, bfloat16 x, and at batch 1 the rate
    it reads W at (weight bytes / kernel time; section 4's copy GB/s is the roofline)."""
    for layer, (n, k) in layers.items():
        for fmt in FORMATS.values():
            for m in QUANT_BATCHES:
                ours, per_call, error = block_gemm_run(fmt, n, k, m, device)
                value = f"{ours:.3f} / {per_call:.3f} ms ({per_call / ours:.1f}x), error {error:.0e}"
                if m == 1:
                    value += f", W read at {n * fmt.row_bytes(k) / ours / 1e6:.0f} GB/s"
                add(rows, section, f"{fmt.name} {layer} batch {m}: triton / dequant+matmul", value,
                    "faster, error <= 1e-2", ours < per_call and error <= 1e-2, dtype="bfloat16")


def format_table(rows: list[Row]) -> str:
    """One aligned line per row under a header; the last column says PASS, FAIL or nothing (no target)."""
    keys = ("section", "metric", *CASE_COLUMNS, "value", "target")
    table = [{**{k: k for k in keys}, "ok": "ok"}, *rows]
    widths = [max(len(str(r[k])) for r in table) for k in keys]
    marks = {True: "PASS", False: "FAIL", None: ""}
    return "\n".join(" | ".join(str(r[k]).ljust(w) for k, w in zip(keys, widths)) + " | " + marks.get(r["ok"], r["ok"])
                     for r in table)
