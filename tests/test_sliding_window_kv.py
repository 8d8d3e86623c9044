"""A model whose every layer slides (Mistral) gives a request's blocks back to the pool as its window moves past them:
the blocks it holds stay bounded by the window while it decodes, other requests reuse them, and the tokens stay
transformers' (chunked prefill, prefix caching, drafts); a model mixing in global layers (Gemma 3) frees a sliding
group of its own instead (tests/test_hybrid_kv.py)."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.core.kv_cache_manager import KVCacheManager, freeing_window
from raylm.cluster.core.request import Request
from raylm.cluster.models.tiny_model import make_tiny_model
from tests.reference import hf_greedy
from tests.rope_checkpoints import widen_weights

WINDOW, BLOCK = 8, 4
MAX_TOKENS = 16
# Three requests, two long past the window; without freeing they need 6 + 10 + 16 = 32 blocks of the pool's 20.
PROMPTS = [[(7 * i + 3 * n) % 490 + 5 for i in range(n)] for n in (5, 21, 45)]
ENGINE: dict[str, Any] = dict(max_model_len=128, block_size=BLOCK, max_num_batched_tokens=32, max_num_seqs=4,
                              num_gpu_blocks_override=20, enable_prefix_caching=False)
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
COMMON = dict(vocab_size=512, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128,
              max_position_embeddings=128, sliding_window=WINDOW)
# Blocks a decoding request can see: its window, which may straddle one block more.
DECODE_BOUND = -(-WINDOW // BLOCK) + 1


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = shutil.copytree(make_tiny_model(arch="mistral", num_layers=2, **COMMON),
                           tmp_path_factory.mktemp("sliding_kv") / "mistral")
    widen_weights(path)  # attention sharp enough that the window shows in the tokens
    return path


@pytest.fixture(scope="module")
def reference(mistral: Path) -> list[list[int]]:
    return [tokens for tokens, _ in hf_greedy(mistral, PROMPTS, MAX_TOKENS)]


def manager(llm: LLM) -> KVCacheManager:
    return llm.llm_engine.engine_core.scheduler.kv_cache_manager


def run_stepwise(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """The requests' tokens, and the most blocks any request held after a step in which it decoded."""
    engine, kv = llm.llm_engine, manager(llm)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, PARAMS)
    tokens: dict[str, list[int]] = {}
    most_held = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] = list(output.outputs[0].token_ids)
        for request in llm.llm_engine.engine_core.scheduler.running:
            if request.num_output_tokens > 1:  # its last step was a decode
                most_held = max(most_held, kv.num_held_blocks(request.request_id))
    return [tokens[str(i)] for i in range(len(prompts))], most_held


@pytest.mark.parametrize(("backend", "block_size", "num_blocks"), [("torch", BLOCK, 20), ("cpu", 16, 6)])
def test_held_blocks_bounded_by_the_window(mistral: Path, reference: list[list[int]], backend: str, block_size: int,
                                           num_blocks: int) -> None:
    """While decoding, a request holds at most the window's blocks, though its 61 tokens span 16 blocks of 4; the
    three requests then share a pool too small for them all at full length without preempting, and give
    transformers' tokens. The freed blocks other requests take stay in a block table: each backend's kernel must
    never count them (raylm's cpu kernel takes blocks of 16)."""
    llm = LLM(model=str(mistral), **{**ENGINE, "block_size": block_size, "num_gpu_blocks_override": num_blocks},
              attention_backend=backend)
    kv = manager(llm)
    assert kv.sliding_window == WINDOW
    tokens, most_held = run_stepwise(llm, PROMPTS)
    scheduler = llm.llm_engine.engine_core.scheduler
    decode_bound = -(-WINDOW // block_size) + 1
    assert tokens == reference
    assert 0 < most_held <= decode_bound
    assert scheduler.num_preemptions == 0
    assert kv.num_free_blocks == kv.num_blocks  # every block came back exactly once

    kv.sliding_window = None  # the same engine keeping every block: the pool is too small for all three
    kept, most_kept = run_stepwise(llm, PROMPTS)
    llm.shutdown()
    assert kept == reference
    assert most_kept > decode_bound and scheduler.num_preemptions > 0


def test_chunks_smaller_than_the_window(mistral: Path, reference: list[list[int]]) -> None:
    """Prompts prefilled 6 tokens a step: each chunk attends over its window across blocks already freed up to it."""
    llm = LLM(model=str(mistral), **{**ENGINE, "max_num_batched_tokens": 6, "max_num_seqs": 1})
    tokens, most_held = run_stepwise(llm, PROMPTS)
    llm.shutdown()
    assert tokens == reference and most_held <= DECODE_BOUND


def test_prefix_caching_on_and_off(mistral: Path, reference: list[list[int]]) -> None:
    """A freed block stays in the prefix cache until evicted: the prompts run again hit their whole prefixes, and a
    longer prompt sharing the 45-token one hits its blocks; the tokens are those without caching."""
    llm = LLM(model=str(mistral), **{**ENGINE, "enable_prefix_caching": True, "num_gpu_blocks_override": 40})
    first = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    extended = PROMPTS[2] + [11, 12, 13, 14, 15]
    [longer] = llm.generate([{"prompt_token_ids": extended}], PARAMS, use_tqdm=False)
    llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in first] == reference
    assert [list(o.outputs[0].token_ids) for o in again] == reference
    assert [o.num_cached_tokens for o in again] == [4, 20, 44]  # full blocks, the last token left to compute
    assert longer.num_cached_tokens == 44
    [(uncached, _)] = hf_greedy(mistral, [extended], MAX_TOKENS)
    assert list(longer.outputs[0].token_ids) == uncached


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_ngram_drafts(mistral: Path, reference: list[list[int]], async_scheduling: bool) -> None:
    """Rejected drafts move the request's computed tokens back (under async scheduling after the next step is
    planned): the blocks their window needs are still held. A request holds its window and the steps out: each of
    its last token and 3 drafts, two such steps under async scheduling (the one planned, the one running)."""
    llm = LLM(model=str(mistral), **ENGINE, async_scheduling=async_scheduling,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    tokens, most_held = run_stepwise(llm, PROMPTS)
    stats = llm.llm_engine.engine_core.scheduler.drafts.stats
    llm.shutdown()
    span = WINDOW - 1 + (2 if async_scheduling else 1) * (1 + 3)
    assert tokens == reference and most_held <= -(-span // BLOCK) + 1
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0, "some drafts accepted, some rejected"


def test_kept_under_a_kv_connector(ray_cluster: Any, mistral: Path, reference: list[list[int]]) -> None:
    """A KV connector (here offloading to host memory, which starts Ray: the module's, wide enough for PP=2 later)
    saves and sends a request's blocks by position: nothing is freed early under it."""
    llm = LLM(model=str(mistral), **{**ENGINE, "num_gpu_blocks_override": 40, "enable_prefix_caching": True},
              kv_offloading_size=0.05)
    assert manager(llm).sliding_window is None
    tokens, most_held = run_stepwise(llm, PROMPTS)
    llm.shutdown()
    assert tokens == reference and most_held == -(-(45 + MAX_TOKENS - 1) // BLOCK)


@pytest.mark.parametrize("enable_caching", [False, True])
def test_manager_frees_what_no_query_sees(enable_caching: bool) -> None:
    """Step by step in the manager: a block goes back once it lies wholly before the window of the next query, its
    id stays in place, each block returns exactly once, and (caching on) a freed block is still a prefix hit."""
    kv = KVCacheManager(16, BLOCK, enable_caching, sliding_window=WINDOW)
    request = Request("a", list(range(100, 130)), SamplingParams(max_tokens=8))
    held = []
    for num_new in (6, 6, 6, 6, 6):  # chunks shorter than the window
        assert kv.allocate_slots(request, num_new) is not None
        held.append(kv.num_held_blocks("a"))
        request.num_computed_tokens += num_new
    # Before the chunk from c: the blocks wholly before c - 7 are freed (c = 18: block 2 holds key 11, still seen).
    assert held == [2, 3, 4, 4, 4]
    assert len(kv.get_block_ids("a")) == 8 and kv.num_free_blocks == 16 - held[-1]
    again = Request("b", list(range(100, 130)), SamplingParams(max_tokens=8))
    hits, num_hit_tokens = kv.get_computed_blocks(again)
    assert num_hit_tokens == (28 if enable_caching else 0)  # the freed head blocks too: their KV is still there
    kv.free(request)
    assert kv.num_free_blocks == 16


def test_global_layers_keep_every_block(mistral: Path, tmp_path: Path) -> None:
    """Freeing needs every layer (a draft model's too) to slide; the widest window decides."""
    gemma3 = AutoConfig.from_pretrained(make_tiny_model(arch="gemma3", num_layers=4, sliding_window_pattern=2,
                                                        **COMMON))
    config = AutoConfig.from_pretrained(mistral)
    wider = AutoConfig.from_pretrained(mistral, sliding_window=2 * WINDOW)
    unwindowed = AutoConfig.from_pretrained(mistral, sliding_window=None)
    assert freeing_window([config]) == WINDOW
    assert freeing_window([config, wider]) == 2 * WINDOW
    assert freeing_window([gemma3]) is None
    assert freeing_window([config, unwindowed]) is None
    assert freeing_window([None]) is None


def test_pp2_on_ray(ray_cluster: Any, mistral: Path, reference: list[list[int]]) -> None:
    """PP=2 on Ray (a layer per stage, two steps in flight, each stage's workers reading the block ids the scheduler
    sent): freed blocks reused by the other requests under the same small pool give transformers' tokens."""
    llm = LLM(model=str(mistral), **ENGINE, pipeline_parallel_size=2, distributed_executor_backend="ray")
    tokens, most_held = run_stepwise(llm, PROMPTS)
    llm.shutdown()
    assert tokens == reference and most_held <= -(-(WINDOW - 1 + 2) // BLOCK) + 1
