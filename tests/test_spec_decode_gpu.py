"""Speculative decoding on CUDA (needs CUDA): greedy float32 output with ngram and draft-model drafts equals the output
without them, with CUDA graphs on for the one-token decodes (k + 1-token batches run eagerly, logged)."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.tools.draft_checkpoint import make_draft_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def generate(path: Path, **settings: Any) -> list[list[int]]:
    rng = random.Random(5)
    passages = [[rng.randrange(5, 512) for _ in range(n)] for n in (12, 40, 77)]
    prompts = [passage + passage[: len(passage) // 2] for passage in passages]
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, device="cuda", **settings)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_greedy_unchanged_on_cuda(llama_path: Path, tmp_path: Path) -> None:
    expected = generate(llama_path)
    draft = make_draft_checkpoint(llama_path, tmp_path / "draft", 1)
    for spec in ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
                 {"method": "draft_model", "num_speculative_tokens": 3, "model": str(draft)}):
        assert generate(llama_path, speculative_config=spec) == expected, spec["method"]
        assert generate(llama_path, speculative_config=spec, async_scheduling=True) == expected, spec["method"]
