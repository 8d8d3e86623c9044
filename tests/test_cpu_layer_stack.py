"""The CPU layer stack (runner/models/cpu_layer_stack.py): steps whose linears all take a kernel it calls (the skinny
kernel, or a quantized layer's block kernels) run the decoder layers in one kernel call, with the same tokens and
logprobs, bit for bit, as the module-by-module path that enforce_eager keeps; layers it cannot run as written keep
that path."""
from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from raylm.cluster import LLM, SamplingParams
from raylm.runner import cpu_kernels
from raylm.runner.layers import gemm_plans
from raylm.runner.layers.cpu_gemm import ROW_BUCKETS, GemmPlan
from raylm.runner.layers.quantization import kernels as block_kernels
from raylm.runner.layers.quantization.ggml_blocks import F8_E4M3, Q4_1, Q8_0, BlockFormat, quantize
from raylm.runner.models.cpu_layer_stack import STACK_KERNELS, CpuLayerStack

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None or not torch.backends.mkldnn.is_available(),
                                reason="needs raylm's CPU kernels and oneDNN")

SKINNY_ROWS = 64
SCHEDULES = {
    "prompts_in_one_step": dict(max_num_batched_tokens=1024),  # prefill past 64 rows: the modules; decodes: the stack
    "chunked_prefill": dict(max_num_batched_tokens=32),  # prompt chunks beside decodes, all through the stack
}


@pytest.fixture
def skinny_plans(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every shape planned to the skinny kernel up to 64 rows and oneDNN past them (what a 2-core EPYC times for
    SmolLM2's shapes), without timing: the tiny test shapes could time either way."""
    monkeypatch.setenv("RAYLM_CACHE_DIR", str(tmp_path))
    plan = GemmPlan(tuple("skinny" if rows <= SKINNY_ROWS else "onednn" for rows in ROW_BUCKETS))
    monkeypatch.setattr(gemm_plans, "time_kernels", lambda layers: (plan, {}))


@pytest.fixture
def stack_rows(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The rows of every step the stack runs (the engine runs in this process)."""
    rows: list[int] = []
    forward = CpuLayerStack.forward

    def counted(self: CpuLayerStack, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        rows.append(hidden_states.shape[0])
        return forward(self, positions, hidden_states, residual)

    monkeypatch.setattr(CpuLayerStack, "forward", counted)
    yield rows


def generate(path: Path, **settings: Any) -> list[tuple[list[int], Any]]:
    llm = LLM(model=str(path), max_model_len=256, block_size=16, enable_prefix_caching=False, max_num_seqs=8,
              **settings)
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 512) for _ in range(n)] for n in (3, 17, 40, 90)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.shutdown()
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_stacked_steps_equal_the_module_path_bit_for_bit(arch: str, schedule: str, dtype: str,
                                                         checkpoints: dict[str, Path], skinny_plans: None,
                                                         stack_rows: list[int]) -> None:
    stacked = generate(checkpoints[arch], dtype=dtype, **SCHEDULES[schedule])
    assert stack_rows and max(stack_rows) <= SKINNY_ROWS
    if schedule == "chunked_prefill":
        assert max(stack_rows) > 4, "prompt chunks (more rows than requests) took the stack too"
    taken = len(stack_rows)
    eager = generate(checkpoints[arch], enforce_eager=True, dtype=dtype, **SCHEDULES[schedule])
    assert len(stack_rows) == taken, "enforce_eager runs module by module"
    assert stacked == eager


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_layers_stack_bit_for_bit(arch: str, dtype: str, checkpoints: dict[str, Path], tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch, stack_rows: list[int]) -> None:
    """Layers quantized to blocks (int4) take the stack through their block kernels: int8 activations at 1-2 rows
    and AMX tiles or else AVX512-BF16 dot products at 3-16 (bfloat16; where the CPU has them), the float32 decode of
    blocks in registers elsewhere up to 64 rows, and a kernel the stack cannot call past them; the same tokens and
    logprobs as the module path."""
    quant_ops = block_kernels.load()
    if quant_ops is None:
        pytest.skip("the quantized kernels could not be built")
    few = "packed_int8" if dtype == "bfloat16" else "packed"
    mid = ("amx" if dtype == "bfloat16" and quant_ops.amx_available()
           else "packed_bf16" if dtype == "bfloat16" and quant_ops.bf16_dot_available() else "packed")
    plan = GemmPlan(tuple(few if rows <= 2 else mid if rows <= 16 else "packed" if rows <= 64 else "onednn"
                          for rows in ROW_BUCKETS))
    monkeypatch.setenv("RAYLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gemm_plans, "time_kernels", lambda layers: (plan, {}))
    settings = dict(dtype=dtype, quantization="int4", **SCHEDULES["chunked_prefill"])
    stacked = generate(checkpoints[arch], **settings)
    assert stack_rows and max(stack_rows) <= 32 and min(stack_rows) <= 16
    taken = len(stack_rows)
    eager = generate(checkpoints[arch], enforce_eager=True, **settings)
    assert len(stack_rows) == taken, "enforce_eager runs module by module"
    assert stacked == eager


def test_layers_it_cannot_run_as_written_keep_the_module_path(checkpoints: dict[str, Path], skinny_plans: None,
                                                              stack_rows: list[int]) -> None:
    generate(checkpoints["qwen3"])  # q/k norm inside the attention
    generate(checkpoints["llama"], custom_ops="none")  # raylm's CPU kernels off
    assert stack_rows == []


Linear = Callable[[torch.Tensor, torch.Tensor, int, "torch.Tensor | None"], torch.Tensor]


def one_kernel_at_a_time(ops: Any, hidden: torch.Tensor, residual: torch.Tensor | None, layer_tensors: list[Any],
                         linear: list[Linear], kv_caches: list[torch.Tensor], step: dict[str, Any],
                         dims: list[int]) -> tuple[Any, Any]:
    """LlamaDecoderLayer.forward's kernel calls, one Python call each, as the module path makes them; linear[i] is
    the i-th linear of every layer's call (qkv, o, gate_up, down)."""
    num_heads, num_kv_heads, head_size, rotary_dim, hidden_size, intermediate = dims
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    n = step["num_actual_tokens"]
    for (norm1, qkv_w, o_w, norm2, gate_up_w, down_w, qkv_b, o_b, gate_up_b, down_b), kv_cache in zip(
            layer_tensors, kv_caches, strict=True):
        if residual is None:
            residual, hidden = hidden, ops.rms_norm(hidden, norm1, step["eps"])
        else:
            ops.fused_add_rms_norm(hidden, residual, norm1, step["eps"])
        q, k, v = linear[0](hidden, qkv_w, q_size + 2 * kv_size, qkv_b).split([q_size, kv_size, kv_size], -1)
        ops.rotary_embedding(step["positions"], q, k, step["cos_sin_cache"], head_size, rotary_dim)
        q, k, v = (t.unflatten(-1, (-1, head_size)) for t in (q, k, v))
        ops.write_kv(k[:n], v[:n], kv_cache[0], kv_cache[1], step["slot_mapping"])
        out = q.new_empty(q.shape)
        out[n:].zero_()
        ops.paged_attention(out, q, kv_cache[0], kv_cache[1], step["block_table"], step["seq_lens"],
                            step["query_start_loc"], step["scale"])
        hidden = linear[1](out.flatten(1), o_w, hidden_size, o_b)
        ops.fused_add_rms_norm(hidden, residual, norm2, step["eps"])
        gate_up = linear[2](hidden, gate_up_w, 2 * intermediate, gate_up_b)
        hidden = linear[3](ops.silu_and_mul(gate_up), down_w, hidden_size, down_b)
    return hidden, residual


# Each linear's kernel (qkv, o, gate_up, down), the block ones on Q4_1 blocks (Q8_0 for down_proj), or on F8_E4M3
# blocks for the `_fp8` ones (an FP8 checkpoint's; packed_int8 never runs them).
LINEAR_KERNELS = {
    "skinny": ("skinny",) * 4,
    "packed": ("packed", "skinny", "packed", "packed"),
    "packed_int8": ("packed_int8", "packed_int8", "skinny", "packed_int8"),
    "amx": ("amx", "amx", "amx", "skinny"),
    "packed_fp8": ("packed", "skinny", "packed", "packed"),
    "amx_fp8": ("amx", "amx", "amx", "skinny"),
    "packed_bf16": ("packed_bf16", "packed_bf16", "skinny", "packed_bf16"),
    "packed_bf16_fp8": ("packed_bf16", "skinny", "packed_bf16", "packed_bf16"),
}


def python_linear(ops: Any, quant_ops: Any, kernel: str, fmt: BlockFormat) -> Linear:
    """The layer's Python path for `kernel` (cpu_gemm.CpuGemmMixin.matmul and quantization/block_quant.py)."""
    if kernel == "skinny":
        return lambda x, w, n, bias: ops.skinny_linear(x, w, n, bias)
    if kernel == "packed":
        return lambda x, w, n, bias: block_kernels.block_linear(
            x.float(), w, fmt, None if bias is None else bias.float(), quant_ops).to(x.dtype)
    if kernel == "packed_int8":
        return lambda x, w, n, bias: block_kernels.int8_linear(x, w, fmt, bias, quant_ops)
    if kernel == "packed_bf16":
        return lambda x, w, n, bias: block_kernels.bf16_linear(x, w, fmt, bias, quant_ops)
    return lambda x, w, n, bias: block_kernels.amx_linear(x, w, fmt, bias, quant_ops)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("build", ["native", "avx2"])
@pytest.mark.parametrize("first_stage", [True, False], ids=["first_stage", "later_stage"])
@pytest.mark.parametrize("kernels", LINEAR_KERNELS)
def test_decoder_layers_make_the_same_kernel_calls(kernels: str, build: str, first_stage: bool,
                                                    dtype: torch.dtype) -> None:
    """The C++ loop against the same kernels called one by one: equal bit for bit, padding rows, biases and a later
    pipeline stage's residual included, in this CPU's build and the AVX2 one (8-float registers, 4-row passes; in
    bfloat16 the AVX2 build widens the weights' pairs where the native one may multiply them with AVX512-BF16); and
    with quantized linears, each block kernel through the quantized kernels' library as the layer's Python path
    calls it (int8 activations, AMX tiles and AVX512-BF16 dot products for bfloat16 only, as the layers use them)."""
    ops = cpu_kernels.load() if build == "native" else cpu_kernels.load_avx2()
    if ops is None:
        pytest.skip("no AVX2 + FMA here, or the kernels could not be built")
    chosen = LINEAR_KERNELS[kernels]
    quant_ops = block_kernels.load()
    if kernels != "skinny" and quant_ops is None:
        pytest.skip("the quantized kernels could not be built")
    if kernels in ("packed_int8", "amx", "amx_fp8", "packed_bf16", "packed_bf16_fp8") and dtype != torch.bfloat16:
        pytest.skip("int8 activations, AMX tiles and bfloat16 dot products run bfloat16 activations only")
    if kernels.startswith("amx") and not (quant_ops is not None and quant_ops.amx_available()):
        pytest.skip("no AMX-BF16 here")
    if kernels.startswith("packed_bf16") and not (quant_ops is not None and quant_ops.bf16_dot_available()):
        pytest.skip("no AVX512-BF16 in the quantized kernels' build here")
    gen = torch.Generator().manual_seed(0)
    dims = [4, 2, 16, 16, 64, 96]  # heads, KV heads, head size, rotary dims, hidden, intermediate
    num_heads, num_kv_heads, head_size, _, hidden_size, intermediate = dims
    query_lens, seq_lens, num_blocks, block_size = [1, 5, 1], [9, 5, 20], 8, 16
    n, num_tokens = sum(query_lens), sum(query_lens) + 2  # two padding rows
    formats = (F8_E4M3,) * 4 if kernels.endswith("_fp8") else (Q4_1, Q4_1, Q4_1, Q8_0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.3).to(dtype)

    def weight(shape: tuple[int, int], kernel: str, fmt: BlockFormat) -> torch.Tensor:
        w = rand(*shape)
        return ops.pack_skinny(w) if kernel == "skinny" else quantize(w.float(), fmt)

    layer_tensors = []
    for with_bias in (True, False):
        linears = [((num_heads + 2 * num_kv_heads) * head_size, hidden_size), (hidden_size, num_heads * head_size),
                   (2 * intermediate, hidden_size), (hidden_size, intermediate)]
        packed = [weight(shape, kernel, fmt) for shape, kernel, fmt in zip(linears, chosen, formats, strict=True)]
        biases = [rand(shape[0]) if with_bias else None for shape in linears]
        layer_tensors.append((1 + rand(hidden_size), packed[0], packed[1], 1 + rand(hidden_size), packed[2], packed[3],
                              *biases))
    positions = torch.tensor([8, 0, 1, 2, 3, 4, 19, 0, 0])
    slot_mapping = torch.tensor([8, 16, 17, 18, 19, 20, 99, -1, -1])
    step = dict(positions=positions, slot_mapping=slot_mapping[:n], num_actual_tokens=n, scale=0.25, eps=1e-5,
                block_table=torch.tensor([[0, 7], [1, 7], [5, 6]], dtype=torch.int32),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                query_start_loc=torch.tensor([0, 1, 6, 7], dtype=torch.int32),
                cos_sin_cache=torch.cat([torch.ones(32, 8), torch.zeros(32, 8)], 1) * 0.9 + rand(32, 16).float() * 0.1)
    caches = [rand(2, num_blocks, num_kv_heads, block_size, head_size) for _ in layer_tensors]
    hidden, residual = rand(num_tokens, hidden_size), None if first_stage else rand(num_tokens, hidden_size)

    expected_caches = [cache.clone() for cache in caches]
    linear = [python_linear(ops, quant_ops, kernel, fmt) for kernel, fmt in zip(chosen, formats, strict=True)]
    expected = one_kernel_at_a_time(ops, hidden.clone(), None if residual is None else residual.clone(), layer_tensors,
                                    linear, expected_caches, step, dims)
    weights = [t for layer in layer_tensors for t in layer[:6]]
    biases = [t for layer in layer_tensors for t in layer[6:]]
    codes = [STACK_KERNELS[kernel] for _ in layer_tensors for kernel in chosen]
    qtypes = [0 if kernel == "skinny" else fmt.ggml_type for _ in layer_tensors
              for kernel, fmt in zip(chosen, formats, strict=True)]
    address = 0 if quant_ops is None else quant_ops.stack_linear_address()
    got = ops.decoder_layers(hidden, residual, positions, weights, biases, caches, step["cos_sin_cache"],
                             step["slot_mapping"], step["block_table"], step["seq_lens"], step["query_start_loc"], n,
                             step["scale"], step["eps"], dims, codes, qtypes, address, block_kernels.MAX_DIRECT_ROWS)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert all(torch.equal(a, b) for a, b in zip(caches, expected_caches, strict=True))
