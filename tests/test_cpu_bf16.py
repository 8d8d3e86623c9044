"""bfloat16 on CPU: each of raylm's kernels against its torch reference in bfloat16, in this CPU's build and the AVX2
one (which widens the weights' pairs where this CPU may multiply them with AVX512-BF16); a bfloat16 engine against
transformers in bfloat16 (equal greedy tokens but at near-ties); and what `dtype: auto` picks on CPU."""
from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from test_attention_torch import make_common_metadata
from test_cpu_kernels import BLOCK_SIZE, HEAD_SHAPES, NUM_BLOCKS, _logical_to_cpu_layout
from transformers import AutoModelForCausalLM

from raylm.cluster import LLM, SamplingParams
from raylm.configs import model_info
from raylm.configs.engine_config import ModelConfig
from raylm.configs.model_info import explain_dtype, read_model_info, resolve_dtype
from raylm.runner import cpu_kernels
from raylm.runner.attention import CPUAttentionBackend, TorchAttentionBackend
from raylm.runner.cpu_kernels import cpu_flags
from raylm.runner.layers.rotary_embedding import RotaryEmbedding, _default_inv_freq
from tests.reference import assert_equal_but_near_ties, greedy_with_logits

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="raylm's CPU kernels could not be built here")

BF16 = torch.bfloat16


@pytest.fixture(params=["native", "avx2"])
def ops(request: pytest.FixtureRequest) -> ModuleType:
    """The kernels as this CPU builds them, or built for AVX2 alone (cpu_kernels.load_avx2)."""
    built = cpu_kernels.load() if request.param == "native" else cpu_kernels.load_avx2()
    if built is None:
        pytest.skip("no AVX2 + FMA here, or the kernels could not be built")
    return built


def test_the_native_build_multiplies_bf16_pairs_where_the_cpu_can() -> None:
    """AVX512-BF16's dot products in the build for a CPU that has them; the widening fallback in every other build,
    so that the AVX2 build tests the fallback on any CPU."""
    assert cpu_kernels.load().native_bf16 == ("avx512_bf16" in cpu_flags().split())
    avx2 = cpu_kernels.load_avx2()
    assert avx2 is None or not avx2.native_bf16


def rand(*shape: int, generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=generator) * scale).to(BF16)


def test_rms_norm(ops: ModuleType) -> None:
    """Against RMSNorm as transformers computes it in bfloat16 (statistics in float32, rounded before the weight);
    the fused residual add rounds the sum exactly as torch's bfloat16 add."""
    gen = torch.Generator().manual_seed(0)
    x, residual, weight = rand(13, 200, generator=gen), rand(13, 200, generator=gen), 1 + rand(200, generator=gen)

    def reference(h: torch.Tensor) -> torch.Tensor:
        h32 = h.float()
        return weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(BF16)

    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), reference(x))
    out, new_residual = x.clone(), residual.clone()
    ops.fused_add_rms_norm(out, new_residual, weight, 1e-5)
    assert torch.equal(new_residual, x + residual)
    torch.testing.assert_close(out, reference(x + residual))


def test_silu_and_mul(ops: ModuleType) -> None:
    gen = torch.Generator().manual_seed(0)
    x = rand(9, 2 * 301, generator=gen, scale=8)  # a tail past the registers; the exp checked where it clamps
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(x), F.silu(gate) * up)


@pytest.mark.parametrize("rotary_dim", [32, 16])
def test_rotary_in_place(ops: ModuleType, rotary_dim: int) -> None:
    """Against the rotation in float32 of the same bfloat16 values, rounded once."""
    gen = torch.Generator().manual_seed(0)
    rope = RotaryEmbedding(32, rotary_dim, 64, _default_inv_freq(10000.0, rotary_dim))
    qkv = rand(7, (4 + 2 + 2) * 32, generator=gen)
    q, k, _ = qkv.split([4 * 32, 2 * 32, 2 * 32], dim=-1)  # strided views, as the models pass them
    positions = torch.tensor([0, 5, 9, 63, 1, 2, 30])
    cos, sin = rope.cos_sin_cache[positions].unsqueeze(-2).chunk(2, dim=-1)
    expected = [rope._rotate(t.float(), cos, sin).to(BF16) for t in (q, k)]
    ops.rotary_embedding(positions, q, k, rope.cos_sin_cache, 32, rotary_dim)
    for got, want in zip((q, k), expected, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("bias", [True, False])
def test_skinny_linear(ops: ModuleType, bias: bool) -> None:
    """bfloat16 panels against F.linear in float32 on the same values: within the output's rounding, for an odd
    input count (a padded last pair), outputs past a panel's edge, rows inside, at and past a pass, and at the
    largest rows a plan times it for."""
    gen = torch.Generator().manual_seed(0)
    weight, b = rand(80, 97, generator=gen), rand(80, generator=gen) if bias else None
    packed = ops.pack_skinny(weight)
    assert packed.dtype == BF16 and packed.shape[1:] == (49, packed.shape[2], 2)
    for rows in (1, 3, 4, 5, 12, 13, 25, 64, 129):
        x = rand(rows, 97, generator=gen)
        got = ops.skinny_linear(x, packed, 80, b)
        expected = F.linear(x.float(), weight.float(), None if b is None else b.float())
        assert got.dtype == BF16
        torch.testing.assert_close(got.float(), expected, rtol=2**-8, atol=1e-3)
    with pytest.raises(RuntimeError, match="activations' dtype"):
        ops.skinny_linear(torch.zeros(1, 97), packed, 80, None)


@pytest.mark.parametrize("heads", HEAD_SHAPES, ids=lambda h: "q{}-kv{}-d{}".format(*h))
@pytest.mark.parametrize(("query_lens", "seq_lens"), [
    ([1, 7, 1, 5, 1], [9, 7, 40, 37, 1]),  # decodes of different lengths, a prefill, a chunk with context
    ([20, 3], [70, 5]),  # chunks with context: the first splits into two query chunks across threads
])
def test_kv_write_and_paged_attention(ops: ModuleType, query_lens: list[int], seq_lens: list[int],
                                      heads: tuple[int, int, int]) -> None:
    """A bfloat16 cache written and read: the new K/V land where the torch backend puts them, bit for bit, and the
    output is the torch backend's in float32 on the same values, within bfloat16's rounding."""
    num_heads, kv_heads, head_size = heads
    gen = torch.Generator().manual_seed(0)
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    block_tables = [[free.pop() for _ in range(-(-s // BLOCK_SIZE))] for s in seq_lens]
    common, _ = make_common_metadata(query_lens, seq_lens, block_tables, BLOCK_SIZE, num_padding_tokens=2)
    logical = rand(*TorchAttentionBackend.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_size),
                   generator=gen)
    cpu_cache = _logical_to_cpu_layout(logical)
    num_tokens, n = sum(query_lens) + 2, sum(query_lens)
    query = rand(num_tokens, num_heads, head_size, generator=gen)
    key, value = (rand(num_tokens, kv_heads, head_size, generator=gen) for _ in range(2))
    torch_backend, cpu_backend = TorchAttentionBackend(), CPUAttentionBackend()
    logical32 = logical.float()
    expected = torch_backend.forward(query.float(), key.float(), value.float(), logical32,
                                     torch_backend.build(common), 0.3)
    metadata = cpu_backend.build(common)
    ops.write_kv(key[:n], value[:n], cpu_cache[0], cpu_cache[1], metadata.slot_mapping)
    assert torch.equal(cpu_cache, _logical_to_cpu_layout(logical32.to(BF16)))
    got = torch.zeros_like(query)
    ops.paged_attention(got, query, cpu_cache[0], cpu_cache[1], metadata.block_table, metadata.seq_lens,
                        metadata.query_start_loc, 0.3)
    torch.testing.assert_close(got.flatten(1)[:n].float(), expected[:n], rtol=2**-7, atol=2e-3)


def transformers_greedy(path: Path, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], torch.Tensor]]:
    """Per prompt: transformers' greedy tokens in bfloat16 and its logits at each position."""
    return greedy_with_logits(AutoModelForCausalLM.from_pretrained(path, dtype=BF16).eval(), prompts, max_tokens)


@pytest.mark.parametrize("schedule", [dict(max_num_batched_tokens=1024), dict(max_num_batched_tokens=32),
                                      dict(max_num_batched_tokens=32, enforce_eager=True)],
                         ids=["one_step", "chunked_prefill", "chunked_prefill_module_path"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_engine_follows_transformers_in_bf16(arch: str, schedule: dict, checkpoints: dict[str, Path]) -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(5, 512) for _ in range(n)] for n in (1, 3, 7, 16, 17, 40, 99, 200)]
    llm = LLM(model=str(checkpoints[arch]), dtype="bfloat16", max_model_len=512, block_size=16,
              enable_prefix_caching=False, max_num_seqs=16, **schedule)
    try:
        assert llm.llm_engine.config.resolved.dtype == "bfloat16"
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    diverged = assert_equal_but_near_ties(transformers_greedy(checkpoints[arch], prompts, 24),
                                          [list(o.outputs[0].token_ids) for o in outputs])
    assert diverged <= 2, f"{diverged} of {len(prompts)} sequences left transformers' tokens"


def test_auto_picks_bf16_on_cpu_for_16_bit_or_quantized_weights_on_a_bf16_cpu(llama_path: Path) -> None:
    info = read_model_info(str(llama_path))
    auto, sixteen_bit = ModelConfig(dtype="auto"), dataclasses.replace(info, checkpoint_dtype="bfloat16")
    for has_bf16 in (True, False):
        cpu = "AVX512-BF16" if has_bf16 else ""
        bf16_if_the_cpu_has_it = "bfloat16" if has_bf16 else "float32"
        assert resolve_dtype(auto, sixteen_bit, "cpu", cpu) == bf16_if_the_cpu_has_it
        assert resolve_dtype(auto, dataclasses.replace(info, checkpoint_dtype="float16"), "cpu", cpu) == (
            bf16_if_the_cpu_has_it)
        assert resolve_dtype(auto, info, "cpu", cpu) == "float32"  # a float32 checkpoint keeps float32 (the oracle's)
        for method in ("int8", "int4"):  # quantized weights compute in bfloat16, whatever the checkpoint stored
            for checkpoint in (info, sixteen_bit):
                assert resolve_dtype(ModelConfig(dtype="auto", quantization=method), checkpoint, "cpu", cpu) == (
                    bf16_if_the_cpu_has_it)
        assert resolve_dtype(ModelConfig(dtype="float32", quantization="int4"), info, "cpu", cpu) == "float32"
        assert resolve_dtype(ModelConfig(dtype="float32"), sixteen_bit, "cpu", cpu) == "float32"
        assert resolve_dtype(ModelConfig(dtype="bfloat16"), info, "cpu", cpu) == "bfloat16"
        assert resolve_dtype(auto, info, "cuda", cpu) == "bfloat16"


def test_the_dtype_line_says_why(llama_path: Path) -> None:
    info = read_model_info(str(llama_path))
    int4 = ModelConfig(dtype="auto", quantization="int4")
    cpu = "AVX512-BF16"
    assert explain_dtype(int4, info, "cpu", cpu) == "bfloat16 (auto: quantized int4 weights, CPU has AVX512-BF16)"
    float16 = dataclasses.replace(info, checkpoint_dtype="float16")
    assert explain_dtype(ModelConfig(dtype="auto"), float16, "cpu", cpu) == (
        "bfloat16 (auto: float16 checkpoint, CPU has AVX512-BF16)")
    assert explain_dtype(ModelConfig(dtype="auto"), info, "cpu", cpu) == "float32 (auto: float32 checkpoint)"
    assert explain_dtype(ModelConfig(dtype="float32", quantization="int4"), info, "cpu", cpu) == "float32 (set)"
    assert explain_dtype(int4, info, "cpu", "") == (
        "float32 (auto: quantized int4 weights, but no bfloat16 dot products on this CPU)")


def test_a_bf16_cpu_is_what_its_flags_and_onednn_say() -> None:
    model_info.cpu_multiplies_bf16.cache_clear()
    flags = set(cpu_flags().split())
    expected = bool({"avx512_bf16", "amx_bf16"} & flags) and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert model_info.cpu_multiplies_bf16() == expected
