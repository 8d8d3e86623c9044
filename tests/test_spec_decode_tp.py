"""Speculative decoding on several devices, a local Ray (CPU, gloo): under TP=2 both ranks propose, verify and (draft
model) run the draft alike, so the greedy tokens are the single device's without drafts, with async scheduling too;
two data-parallel engines each speculate on their share, and their counters add up."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.models.tiny_model import make_tiny_model
from raylm.cluster.tools.draft_checkpoint import make_draft_checkpoint
from raylm.executor.ray_executor import RayExecutor

ENGINE = dict(max_model_len=128, block_size=8, max_num_batched_tokens=32, num_gpu_blocks_override=24)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tp") / "llama3", num_layers=3, hidden_size=64,
                           intermediate_size=128, vocab_size=512)


def generate(llm: LLM) -> list[list[int]]:
    rng = random.Random(3)
    passages = [[rng.randrange(5, 512) for _ in range(n)] for n in (8, 21, 30)]
    prompts = [passage + passage[: len(passage) // 2] for passage in passages]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                              use_tqdm=False)]


@pytest.mark.slow
@pytest.mark.parametrize(("method", "async_scheduling", "layout"), [
    ("ngram", False, "tp2"), ("ngram", True, "tp2"), ("draft_model", True, "tp2"), ("ngram", False, "dp2")])
def test_matches_the_single_device(ray_cluster: Any, model_path: Path, tmp_path: Path, method: str,
                                   async_scheduling: bool, layout: str) -> None:
    single = LLM(model=str(model_path), **ENGINE)
    expected = generate(single)
    single.shutdown()
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        spec["prompt_lookup_min"] = 1
    else:
        spec["model"] = str(make_draft_checkpoint(model_path, tmp_path / "draft", 2))
    parallel = {"tensor_parallel_size": 2} if layout == "tp2" else {"data_parallel_size": 2}
    llm = LLM(model=str(model_path), async_scheduling=async_scheduling, speculative_config=spec, **parallel,
              **ENGINE)
    engine_core = llm.llm_engine.engine_core
    if layout == "tp2":
        assert isinstance(engine_core.executor, RayExecutor)
    ours = generate(llm)
    per_engine = engine_core.engine_stats()
    llm.shutdown()
    assert ours == expected
    assert len(per_engine) == (2 if layout == "dp2" else 1)
    assert all(stats.spec_decoding is not None and stats.spec_decoding.num_draft_tokens > 0 for stats in per_engine)
