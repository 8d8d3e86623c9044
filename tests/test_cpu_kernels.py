"""raylm's CPU kernels against the plain-torch ops they replace, and the cpu attention backend against the
torch backend on the same batches and the same (logical) cache contents."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import pytest
import torch
from test_attention_torch import make_common_metadata

from raylm.configs import make_engine_config
from raylm.runner import cpu_kernels
from raylm.runner.attention import CPUAttentionBackend, TorchAttentionBackend, choose_attn_backend
from raylm.runner.layers.activation import SiluAndMul
from raylm.runner.layers.layernorm import RMSNorm
from raylm.runner.layers.rotary_embedding import RotaryEmbedding, _default_inv_freq

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="raylm's CPU kernels could not be built here")

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 24, 16, 24


T = TypeVar("T")


@contextmanager
def kernels_off() -> Iterator[None]:
    cpu_kernels.set_enabled(False)
    try:
        yield
    finally:
        cpu_kernels.set_enabled(True)


@pytest.fixture
def plain_torch() -> Iterator[None]:
    with kernels_off():
        yield


def _without_kernels(fn: Callable[..., T], *args: Any) -> T:
    with kernels_off():
        return fn(*args)


@pytest.fixture(params=["native", "avx2"])
def kernel_build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels as this CPU builds them, or built for AVX2 alone (cpu_kernels.load_avx2: 8-float registers and
    8-key tiles) standing in for them wherever the native build would run."""
    if request.param == "avx2":
        ops = cpu_kernels.load_avx2()
        if ops is None:
            pytest.skip("no AVX2 + FMA here, or the kernels could not be built")
        native = cpu_kernels.ops_for
        monkeypatch.setattr(cpu_kernels, "ops_for", lambda x: ops if native(x) is not None else None)


def test_rms_norm_and_fused_residual_add(kernel_build: None) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(200, eps=1e-5)
    norm.weight.data.uniform_(0.5, 1.5)
    x, residual = torch.randn(13, 200), torch.randn(13, 200)
    torch.testing.assert_close(norm(x), _without_kernels(norm, x), rtol=1e-6, atol=1e-6)
    expected = _without_kernels(norm, x.clone(), residual.clone())
    out, new_residual = norm(x.clone(), residual.clone())
    torch.testing.assert_close(out, expected[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(new_residual, expected[1], rtol=0, atol=0)
    heads = torch.randn(5, 3, 200)  # Qwen3's per-head q/k norm: any leading shape
    torch.testing.assert_close(norm(heads), _without_kernels(norm, heads), rtol=1e-6, atol=1e-6)


def test_silu_and_mul(kernel_build: None) -> None:
    torch.manual_seed(0)
    x = torch.randn(9, 2 * 301) * 8  # wide range: the vectorised exp is checked where it clamps
    torch.testing.assert_close(SiluAndMul()(x), _without_kernels(SiluAndMul(), x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rotary_dim", [32, 16])
def test_rotary_in_place(rotary_dim: int, kernel_build: None) -> None:
    torch.manual_seed(0)
    rope = RotaryEmbedding(32, rotary_dim, 64, _default_inv_freq(10000.0, rotary_dim))
    qkv = torch.randn(7, (4 + 2 + 2) * 32)
    q, k, _ = qkv.split([4 * 32, 2 * 32, 2 * 32], dim=-1)  # strided views, as the models pass them
    positions = torch.tensor([0, 5, 9, 63, 1, 2, 30])
    expected = _without_kernels(rope, positions, q.clone(), k.clone())
    got = rope(positions, q, k)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_kernels_run_without_the_gil() -> None:
    """A long kernel call leaves the GIL to the process's other Python threads (a server's event loop, async
    scheduling), as torch's own ops do: this thread's longest stall stays far below the call's length."""
    ops = cpu_kernels.load()
    packed, rows = ops.pack_skinny(torch.randn(4096, 1024)), 512
    seconds: list[float] = []

    def call() -> None:
        start = time.perf_counter()
        ops.skinny_linear(x, packed, 4096, None)
        seconds.append(time.perf_counter() - start)

    while True:  # a call long enough (50 ms) that holding the GIL through it would show beside the switch interval
        x = torch.randn(rows, 1024)
        call()
        if seconds[-1] > 0.05 or rows >= 2**16:
            break
        rows *= 2
    thread = threading.Thread(target=call)
    longest_stall, last = 0.0, time.perf_counter()
    thread.start()
    while thread.is_alive():
        now = time.perf_counter()
        longest_stall, last = max(longest_stall, now - last), now
    thread.join()
    assert longest_stall < seconds[-1] / 2, (longest_stall, seconds[-1])


def _logical_to_cpu_layout(logical: torch.Tensor) -> torch.Tensor:
    """[2, blocks, block, kv_heads, D] (the torch backend's layout) -> the cpu backend's layout."""
    num_blocks, _, kv_heads, head_size = logical.shape[1:]
    key = logical[0].permute(0, 2, 3, 1).contiguous()  # [blocks, kv_heads, D, block]: key tiles transposed
    value = logical[1].permute(0, 2, 1, 3).contiguous()  # [blocks, kv_heads, block, D]
    shape = CPUAttentionBackend.get_kv_cache_shape(num_blocks, BLOCK_SIZE, kv_heads, head_size)
    return torch.stack([key.view(shape[1:]), value]).contiguous()


# (query heads, KV heads, head size): head sizes off the kernel's value slabs (AVX-512's 64 floats: 24 runs its
# remainder loop, 80 a slab and a remainder; AVX2's 16 floats at 4 rows: 24), on them (64, 128), and a group of 8
# query heads per KV head, two row blocks of the kernel.
HEAD_SHAPES = [(HEADS, KV_HEADS, HEAD_SIZE), (9, 3, 64), (4, 2, 80), (8, 1, 128)]


@pytest.mark.parametrize("heads", HEAD_SHAPES, ids=lambda h: "q{}-kv{}-d{}".format(*h))
@pytest.mark.parametrize(("query_lens", "seq_lens"), [
    ([1, 7, 1, 5, 1], [9, 7, 40, 37, 1]),  # decodes of different lengths, a prefill, a chunk with context
    ([1, 1, 1], [16, 17, 33]),  # decodes at block edges
    ([40], [40]),  # one prompt
    ([20, 3], [70, 5]),  # chunks with context: the first splits into two query chunks across threads
])
def test_cpu_backend_matches_torch_backend(query_lens: list[int], seq_lens: list[int], heads: tuple[int, int, int],
                                           kernel_build: None) -> None:
    num_heads, kv_heads, head_size = heads
    generator = torch.Generator().manual_seed(0)
    free = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    block_tables = [[free.pop() for _ in range(-(-s // BLOCK_SIZE))] for s in seq_lens]
    common, _ = make_common_metadata(query_lens, seq_lens, block_tables, BLOCK_SIZE, num_padding_tokens=2)
    logical = torch.randn(TorchAttentionBackend.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_size),
                          generator=generator)  # stands in for the context of earlier steps
    cpu_cache = _logical_to_cpu_layout(logical)
    num_tokens = sum(query_lens) + 2
    query = torch.randn(num_tokens, num_heads, head_size, generator=generator)
    key, value = (torch.randn(num_tokens, kv_heads, head_size, generator=generator) for _ in range(2))
    torch_backend, cpu_backend = TorchAttentionBackend(), CPUAttentionBackend()
    expected = torch_backend.forward(query, key, value, logical, torch_backend.build(common), 0.3)
    got = cpu_backend.forward(query, key, value, cpu_cache, cpu_backend.build(common), 0.3)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(cpu_cache, _logical_to_cpu_layout(logical))  # both wrote the same new K/V


def _paged_step(query_lens: list[int], seq_lens: list[int], heads: tuple[int, int, int], seed: int
                ) -> tuple[Any, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """A step's metadata over random block tables, a random KV cache in the torch backend's layout and the CPU
    kernel's, and the step's query, key and value."""
    num_heads, kv_heads, head_size = heads
    generator = torch.Generator().manual_seed(seed)
    free = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    block_tables = [[free.pop() for _ in range(-(-s // BLOCK_SIZE))] for s in seq_lens]
    common, _ = make_common_metadata(query_lens, seq_lens, block_tables, BLOCK_SIZE)
    logical = torch.randn(TorchAttentionBackend.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_size),
                          generator=generator)
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_heads, head_size, generator=generator)
    key, value = (torch.randn(num_tokens, kv_heads, head_size, generator=generator) for _ in range(2))
    return common, logical, _logical_to_cpu_layout(logical), (query, key, value)


@pytest.mark.parametrize(("window", "cap"), [(5, None), (17, 0.5), (40, None), (None, 0.5)])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 2, 80)], ids=lambda h: "q{}-kv{}-d{}".format(*h))
@pytest.mark.parametrize(("query_lens", "seq_lens"), [
    ([1, 7, 1, 5, 1], [9, 7, 40, 37, 1]),
    ([1, 1, 1], [16, 17, 70]),
    ([40], [40]),
    ([20, 3], [70, 5]),
])
def test_cpu_backend_window_and_cap_match_torch_backend(query_lens: list[int], seq_lens: list[int],
                                                        heads: tuple[int, int, int], window: int | None,
                                                        cap: float | None, kernel_build: None) -> None:
    """A sliding window (shorter than a tile, across tiles, over whole sequences) and a logit soft-cap: the kernel
    skips the tiles before every row's window, which the torch backend (checked against a naive reference in
    test_attention_sliding.py) masks."""
    common, logical, cpu_cache, (query, key, value) = _paged_step(query_lens, seq_lens, heads, seed=1)
    query = query * 3  # sharp: the cap matters
    torch_backend, cpu_backend = TorchAttentionBackend(), CPUAttentionBackend()
    expected = torch_backend.forward(query, key, value, logical, torch_backend.build(common), 0.3,
                                     sliding_window=window, logits_soft_cap=cap)
    got = cpu_backend.forward(query, key, value, cpu_cache, cpu_backend.build(common), 0.3, sliding_window=window,
                              logits_soft_cap=cap)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("window", "cap"), [(None, None), (5, None), (17, 0.5)])
@pytest.mark.parametrize(("query_lens", "seq_lens"), [([1, 7, 1, 5, 1], [9, 7, 40, 37, 1]), ([20, 3], [70, 5])])
def test_cpu_backend_sinks_match_torch_backend(query_lens: list[int], seq_lens: list[int], window: int | None,
                                               cap: float | None, kernel_build: None) -> None:
    """GPT-OSS's attention sinks (a logit per query head in each softmax's denominator), alone and with a window or
    a cap, on decodes, chunks and a prompt: some sinks far above the scores (a row's weights nearly vanish), some far
    below (nearly no effect)."""
    common, logical, cpu_cache, (query, key, value) = _paged_step(query_lens, seq_lens, (8, 2, 64), seed=2)
    sinks = torch.tensor([-20.0, -1.0, 0.0, 0.5, 1.0, 2.0, 4.0, 20.0])
    torch_backend, cpu_backend = TorchAttentionBackend(), CPUAttentionBackend()
    expected = torch_backend.forward(query, key, value, logical, torch_backend.build(common), 0.3,
                                     sliding_window=window, logits_soft_cap=cap, sinks=sinks)
    got = cpu_backend.forward(query, key, value, cpu_cache, cpu_backend.build(common), 0.3, sliding_window=window,
                              logits_soft_cap=cap, sinks=sinks)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    without = torch_backend.forward(query, key, value, logical, torch_backend.build(common), 0.3,
                                    sliding_window=window, logits_soft_cap=cap)
    assert not torch.allclose(expected, without, atol=1e-3)  # the sinks change every row's weights


def test_backend_choice_and_errors() -> None:
    assert choose_attn_backend("auto", "cpu", torch.float32, 16) == CPUAttentionBackend.name
    assert choose_attn_backend("auto", "cpu", torch.float32, 8) == TorchAttentionBackend.name
    with pytest.raises(ValueError, match="multiple of 16"):
        choose_attn_backend("cpu", "cpu", torch.float32, 8)
    assert choose_attn_backend("auto", "cpu", torch.bfloat16, 16) == CPUAttentionBackend.name
    with pytest.raises(ValueError, match="it runs float32 or bfloat16 \\(dtype here: float16\\)"):
        choose_attn_backend("cpu", "cpu", torch.float16, 16)
    with pytest.raises(ValueError, match="custom_ops='none'"):
        make_engine_config(attention_backend="cpu", custom_ops="none")


def test_disabled_kernels_pick_the_torch_backend(plain_torch: None) -> None:
    assert choose_attn_backend("auto", "cpu", torch.float32, 16, custom_ops=False) == TorchAttentionBackend.name
    assert cpu_kernels.ops_for(torch.zeros(1)) is None


def test_a_failed_build_falls_back_with_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(cpu_kernels, "_CFLAGS", ["-fno-such-flag-raylm"])
    assert cpu_kernels.load.__wrapped__() is None  # the uncached function: a fresh build attempt
    assert "raylm CPU kernels unavailable, using plain torch ops" in caplog.text
