"""A model mixing sliding-window and global layers (Gemma 3, GPT-OSS) keeps its sliding layers' KV in a group of its
own (configs/kv_cache_groups.py): while a long request decodes, that group holds only the blocks its window sees,
the global layers keep every block, and the tokens stay transformers' (both backends, chunked prefill, prefix
caching, the same engine without freeing)."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.core.kv_cache_manager import KVCacheManager
from raylm.cluster.core.request import Request
from raylm.cluster.core.sliding_window_group import SlidingWindowGroup
from raylm.cluster.models.tiny_model import make_tiny_model
from tests.reference import hf_greedy
from tests.rope_checkpoints import widen_weights

WINDOW, BLOCK = 8, 4
MAX_TOKENS = 16
PROMPTS = [[(7 * i + 3 * n) % 490 + 5 for i in range(n)] for n in (5, 21, 45)]
# A budget of 40 blocks of every layer: the sliding pool takes 2 * (ceil((8 - 1 + 16) / 4) + 1) = 14, the global
# pool the rest, (40 * 4 - 14 * 2) / 2 = 66.
ENGINE: dict[str, Any] = dict(max_model_len=128, block_size=BLOCK, max_num_batched_tokens=16, max_num_seqs=2,
                              num_gpu_blocks_override=40, enable_prefix_caching=False)
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# 4 layers: sliding, global, sliding, global.
GEMMA3 = dict(arch="gemma3", num_layers=4, sliding_window_pattern=2, vocab_size=512, hidden_size=64, num_heads=4,
              num_kv_heads=2, intermediate_size=128, max_position_embeddings=128, sliding_window=WINDOW)


def decode_bound(block_size: int) -> int:
    """Blocks a decoding request's window can see: it may straddle one block more."""
    return -(-WINDOW // block_size) + 1


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = shutil.copytree(make_tiny_model(**GEMMA3), tmp_path_factory.mktemp("hybrid_kv") / "gemma3")
    widen_weights(path)  # attention sharp enough that the window shows in the tokens
    return path


@pytest.fixture(scope="module")
def reference(gemma3: Path) -> list[list[int]]:
    return [tokens for tokens, _ in hf_greedy(gemma3, PROMPTS, MAX_TOKENS)]


def manager(llm: LLM) -> KVCacheManager:
    return llm.llm_engine.engine_core.scheduler.kv_cache_manager


def sliding_group(llm: LLM) -> SlidingWindowGroup:
    group = manager(llm).sliding_group
    assert group is not None, "the engine split its KV cache in two groups"
    return group


def run_stepwise(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], int, int]:
    """The requests' tokens, and the most sliding-group and global blocks any request held after a decode step."""
    engine, kv, group = llm.llm_engine, manager(llm), sliding_group(llm)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, PARAMS)
    tokens: dict[str, list[int]] = {}
    most_sliding = most_global = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] = list(output.outputs[0].token_ids)
        for request in engine.engine_core.scheduler.running:
            if request.num_output_tokens > 1:  # its last step was a decode
                most_sliding = max(most_sliding, group.num_held_blocks(request.request_id))
                most_global = max(most_global, kv.num_held_blocks(request.request_id))
    return [tokens[str(i)] for i in range(len(prompts))], most_sliding, most_global


@pytest.mark.parametrize(("backend", "block_size"), [("torch", BLOCK), ("cpu", 16)])
def test_sliding_group_held_bounded_by_the_window(gemma3: Path, reference: list[list[int]], backend: str,
                                                  block_size: int) -> None:
    """The 61-token request's sliding layers hold its window's blocks while the global layers hold all of them; the
    sliding layers' KV tensors are the sliding pool's size. The same engine without freeing gives the same tokens,
    transformers' (raylm's cpu kernel takes blocks of 16). Without freeing, the 61-token request would never fit the
    sliding pool."""
    llm = LLM(model=str(gemma3), **{**ENGINE, "block_size": block_size}, attention_backend=backend)
    kv, group = manager(llm), sliding_group(llm)
    assert group.sliding_window == WINDOW
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    sizes = {layer.sliding_window: layer.kv_cache.shape[1] for layer in runner.attention_layers()}
    assert sizes == {WINDOW: group.block_pool.num_blocks, None: kv.num_blocks}
    tokens, most_sliding, most_global = run_stepwise(llm, PROMPTS)
    assert tokens == reference
    assert 0 < most_sliding <= decode_bound(block_size) < most_global == -(-(45 + MAX_TOKENS - 1) // block_size)
    assert group.block_pool.num_free_blocks == group.block_pool.num_blocks  # each block came back exactly once
    assert kv.num_free_blocks == kv.num_blocks

    # The same engine keeping every sliding block: the two shorter requests, which its 14-block sliding pool holds.
    group.sliding_window = 10 ** 6
    kept, most_kept, _ = run_stepwise(llm, PROMPTS[:2])
    llm.shutdown()
    assert kept == reference[:2] and most_kept == -(-(21 + MAX_TOKENS - 1) // block_size) > decode_bound(block_size)


def test_chunks_smaller_than_the_window(gemma3: Path, reference: list[list[int]]) -> None:
    """Prompts prefilled 6 tokens a step: each chunk's sliding layers attend across blocks already freed up to it."""
    llm = LLM(model=str(gemma3), **{**ENGINE, "max_num_batched_tokens": 6, "max_num_seqs": 1})
    tokens, most_sliding, _ = run_stepwise(llm, PROMPTS)
    llm.shutdown()
    assert tokens == reference and most_sliding <= decode_bound(BLOCK)


def test_prefix_caching_on_and_off(gemma3: Path, reference: list[list[int]]) -> None:
    """A hit needs both groups' blocks: the global layers' for the whole prefix, the sliding layers' for its last
    window (freed ones stay cached until evicted). The prompts run again hit their whole prefixes, a longer prompt
    sharing the 45-token one hits its blocks; the tokens are those without caching."""
    # A sliding pool of 4 * (ceil((8 - 1 + 32) / 4) + 1) = 44 blocks: the three requests' freed blocks stay cached.
    llm = LLM(model=str(gemma3), **{**ENGINE, "enable_prefix_caching": True, "num_gpu_blocks_override": 60,
                                    "max_num_seqs": 4, "max_num_batched_tokens": 32})
    first = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    extended = PROMPTS[2] + [11, 12, 13, 14, 15]
    [longer] = llm.generate([{"prompt_token_ids": extended}], PARAMS, use_tqdm=False)
    llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in first] == reference
    assert [list(o.outputs[0].token_ids) for o in again] == reference
    assert [o.num_cached_tokens for o in again] == [4, 20, 44]  # full blocks, the last token left to compute
    assert longer.num_cached_tokens == 44
    [(uncached, _)] = hf_greedy(gemma3, [extended], MAX_TOKENS)
    assert list(longer.outputs[0].token_ids) == uncached


def test_hit_needs_the_sliding_window_blocks() -> None:
    """In the manager: once the sliding group has evicted a prefix's last window, the global blocks alone are no
    hit; a hit's sliding positions before its window get id 0 (masked), and every block returns once."""
    kv = KVCacheManager(16, BLOCK, True, sliding_group=SlidingWindowGroup(6, BLOCK, WINDOW, True))
    group = kv.sliding_group
    assert group is not None
    first = Request("a", list(range(100, 124)), SamplingParams(max_tokens=8))
    assert kv.allocate_slots(first, 24) is not None
    first.num_computed_tokens = 24
    kv.free(first)
    again = Request("b", list(range(100, 124)), SamplingParams(max_tokens=8))
    hits, num_hit_tokens = kv.get_computed_blocks(again)
    assert num_hit_tokens == 20  # 5 full blocks, the last token left to compute
    assert kv.allocate_slots(again, 4, num_hit_tokens, hits) is not None
    assert group.get_block_ids("b")[:3] == [0, 0, 0]  # positions 0..11 lie before the window of query 20
    assert group.num_held_blocks("b") == 3  # blocks 3, 4 (hits) and 5 (new)
    kv.free(again)
    other = Request("c", list(range(300, 324)), SamplingParams(max_tokens=8))  # evicts the sliding group's blocks
    assert kv.allocate_slots(other, 24) is not None
    kv.free(other)
    third = Request("d", list(range(100, 124)), SamplingParams(max_tokens=8))
    assert kv.get_computed_blocks(third) == ([], 0)
    assert kv.num_free_blocks == 16 and group.block_pool.num_free_blocks == 6


def test_usage_counts_the_fuller_pool() -> None:
    """A pool of 6 sliding blocks fills before the 32 global ones: usage (the metric, the router's load) says so."""
    kv = KVCacheManager(32, BLOCK, True, sliding_group=SlidingWindowGroup(6, BLOCK, WINDOW, True))
    request = Request("a", list(range(100, 120)), SamplingParams(max_tokens=8))
    assert kv.allocate_slots(request, 20) is not None  # 5 global blocks; 5 sliding ones until the window moves
    assert kv.usage == 5 / 6


def test_gpt_oss_alternating_layers(tmp_path: Path) -> None:
    """GPT-OSS (sinks, sliding and global layers alternating): its sliding group stays within the window while the
    tokens are transformers'."""
    from tests.test_gpt_oss import write_checkpoint

    path = write_checkpoint(tmp_path / "tiny-gpt-oss")
    [(expected, _)] = hf_greedy(path, [PROMPTS[2]], MAX_TOKENS)
    llm = LLM(model=str(path), **{**ENGINE, "block_size": 16}, attention_backend="cpu")
    tokens, most_sliding, _ = run_stepwise(llm, [PROMPTS[2]])
    llm.shutdown()
    assert tokens == [expected] and most_sliding <= decode_bound(16)


def test_sliding_group_under_decode_graphs(gemma3: Path, reference: list[list[int]]) -> None:
    """The decode graphs' body (what a CUDA graph captures, run eagerly here: EagerGraphs) reads the sliding layers'
    own block table, slots and scratch block from the runner's persistent buffers: the tokens are transformers' while
    the sliding layers hold only their window's blocks, and the decode steps took the replay path."""
    from tests.test_batch_padding import EagerGraphs

    llm = LLM(model=str(gemma3), **ENGINE, attention_backend="torch", cudagraph_capture_sizes=[1, 2])
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    assert runner.graphs.sliding_scratch_slot == sliding_group(llm).block_pool.num_blocks * BLOCK
    graphs = EagerGraphs(runner)
    runner.graphs.runner = graphs
    tokens, most_sliding, most_global = run_stepwise(llm, PROMPTS)
    llm.shutdown()
    assert tokens == reference
    assert 0 < most_sliding <= decode_bound(BLOCK) < most_global
    assert len(graphs.replayed) > MAX_TOKENS  # the decode steps of the three requests


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sliding_group_in_captured_graphs(gemma3: Path, backend: str) -> None:
    """On CUDA (graphs on by default) the sliding group splits, the decode steps replay captured graphs, and the
    tokens equal an eager engine's while the sliding layers hold only their window's blocks."""
    settings = dict(ENGINE, attention_backend=backend, dtype="float32")
    eager = LLM(model=str(gemma3), **settings, enforce_eager=True)
    expected, _, _ = run_stepwise(eager, PROMPTS)
    eager.shutdown()
    llm = LLM(model=str(gemma3), **settings)
    graphs = llm.llm_engine.engine_core.executor.worker.model_runner.graphs
    tokens, most_sliding, most_global = run_stepwise(llm, PROMPTS)
    replayed = sum(graphs.report()["replayed"].values())
    llm.shutdown()
    assert tokens == expected
    assert 0 < most_sliding <= decode_bound(BLOCK) < most_global
    assert replayed > MAX_TOKENS


def test_one_group_where_paths_need_one(gemma3: Path) -> None:
    """Speculative decoding (drafts share the target's block table) keeps one group: every block kept."""
    llm = LLM(model=str(gemma3), **ENGINE,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1})
    kv = manager(llm)
    llm.shutdown()
    assert kv.sliding_group is None and kv.sliding_window is None
