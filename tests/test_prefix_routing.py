"""Prefix-aware routing (routing_policy "prefix"): the router's choice (longest cached prefix while loads are within the
threshold, else least loaded; a poor match goes by load; an engine's index is bounded by its pool), the policy the
resolver picks, and two data-parallel engines on a local Ray: a conversation's turns stay on one engine while the
loads are balanced, and a burst sharing one prefix spreads once they are not."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.dp.dp_client import DPEngineCoreClient
from raylm.cluster.dp.prefix_router import PrefixAwareLoadBalancer, PrefixRouter, text_block_hashes, token_block_hashes
from raylm.cluster.engine.llm_engine import LLMEngine
from raylm.configs import make_engine_config
from raylm.configs.kv_transfer import RoutingConfig
from raylm.configs.resolve_sections import resolve_routing_policy

BLOCK = 16
ENGINE = dict(max_model_len=512, block_size=BLOCK, max_num_seqs=16, num_gpu_blocks_override=96)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 512) for _ in range(n)]


def test_router_prefers_the_longest_prefix_while_balanced() -> None:
    router: PrefixRouter[str] = PrefixRouter(RoutingConfig(routing_imbalanced_threshold=4))
    a, b = token_block_hashes(tokens(64, 1), BLOCK), token_block_hashes(tokens(64, 2), BLOCK)
    assert router.choose(a, {"x": 0, "y": 0}) == "x"  # nothing cached: least loaded, first in order
    assert router.choose(b, {"x": 0, "y": 0}) == "y"  # equal loads: the one caching less
    assert router.choose(a[:2] + b[2:], {"x": 3, "y": 0}) == "x"  # its first two blocks, within the threshold
    assert router.choose(b, {"x": 0, "y": 4}) == "y"
    assert router.choose(b, {"x": 0, "y": 5}) == "x"  # imbalanced: the least loaded, which now caches b too
    assert router.match("x", b) == len(b)
    assert (router.num_prefix_routed, router.num_load_routed) == (2, 3)


def test_router_ignores_a_poor_match_and_bounds_each_index() -> None:
    router: PrefixRouter[int] = PrefixRouter(RoutingConfig(routing_match_rate_threshold=0.5))
    router.set_capacity(0, 4)
    router.set_capacity(1, 4)
    long = token_block_hashes(tokens(160, 3), BLOCK)  # ten blocks: engine 0 keeps the last four only
    assert router.choose(long, {0: 0, 1: 0}) == 0
    assert router.match(0, long) == 0 and router.match(0, long[6:]) == 4
    prompt = token_block_hashes(tokens(64, 4), BLOCK)
    router.insert(1, prompt[:1])
    assert router.choose(prompt, {0: 0, 1: 1}) == 0  # one block of four matched: below half, so by load
    assert text_block_hashes("a" * 130)[:2] == text_block_hashes("a" * 128 + "bc")[:2]
    assert len(text_block_hashes("short")) == 0


def test_balancer_spreads_a_shared_prefix_burst_by_the_threshold() -> None:
    prompt = tokens(48, 5)
    balancer = PrefixAwareLoadBalancer([64, 64], BLOCK, RoutingConfig(routing_imbalanced_threshold=8))
    chosen = [balancer.choose(prompt) for _ in range(6)]
    # Each request in flight counts 4: the third makes engine 0 8 ahead, so the fourth goes to engine 1.
    assert chosen[:4] == [0, 0, 0, 1] and set(chosen) == {0, 1}
    sticky = PrefixAwareLoadBalancer([64, 64], BLOCK, RoutingConfig(routing_imbalanced_threshold=1000))
    assert {sticky.choose(prompt) for _ in range(6)} == {0}


def test_resolver_picks_prefix_where_prefix_caching_is_on() -> None:
    assert resolve_routing_policy(make_engine_config()) == "prefix"
    assert resolve_routing_policy(make_engine_config(enable_prefix_caching=False)) == "load"
    assert resolve_routing_policy(make_engine_config(routing_policy="load")) == "load"
    with pytest.raises(ValueError, match="routing_policy 'prefix'.*enable_prefix_caching"):
        resolve_routing_policy(make_engine_config(routing_policy="prefix", enable_prefix_caching=False))


def _serve_turn(engine: LLMEngine, prompts: dict[str, list[int]], turn: int) -> tuple[dict[str, int], dict[str, list]]:
    """One turn of every conversation at once: the engine each went to, and its answer."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    placed = {name: engine.add_request(f"{name}-{turn}", {"prompt_token_ids": prompt}, params,
                                       output_kind="final")[1] for name, prompt in prompts.items()}
    answers: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                answers[output.request_id.rsplit("-", 1)[0]] = output.outputs[0].token_ids
    return placed, answers


def test_conversations_stay_on_their_engine(ray_cluster: Any, llama_path: Path) -> None:
    llm = LLM(model=str(llama_path), data_parallel_size=2, **ENGINE)
    try:
        engine = llm.llm_engine
        client = engine.engine_core
        assert isinstance(client, DPEngineCoreClient) and isinstance(client.balancer, PrefixAwareLoadBalancer)
        history = {f"conv{i}": tokens(40, 10 + i) for i in range(4)}
        engines: dict[str, set[int]] = {name: set() for name in history}
        for turn in range(3):
            placed, answers = _serve_turn(engine, history, turn)
            for name in history:
                engines[name].add(placed[name])
                history[name] = history[name] + answers[name] + tokens(12, 100 * turn + len(name))
        assert all(len(used) == 1 for used in engines.values()), engines
        assert {next(iter(used)) for used in engines.values()} == {0, 1}  # both engines serve
        hits = sum(stats.prefix_cache_hits for stats in client.engine_stats())
        # Turns 2 and 3 find the blocks the previous turn computed whole (2 of 47 tokens, 4 of 67) on their engine.
        assert hits >= 4 * (32 + 64), hits
        # A burst of requests sharing one long prefix spreads once the loads part.
        placed, _ = _serve_turn(engine, {f"burst{i}": history["conv0"] + tokens(5, 500 + i) for i in range(6)}, 9)
        assert set(placed.values()) == {0, 1}, placed
    finally:
        llm.shutdown()
