"""An engine whose memory leaves no room for one request of max_model_len fails at start-up, naming the numbers."""
from __future__ import annotations

from pathlib import Path

import pytest

from raylm.cluster import LLM
from raylm.worker.worker import MemoryProfile


def test_no_room_for_one_request_is_a_clear_error(llama_path: Path) -> None:
    with pytest.raises(ValueError, match=r"the KV cache has room for \d+ blocks of 16 tokens \(\d+ bytes each\), but "
                                         r"one request of max_model_len=256 tokens needs 16: rank 0: budget 0\.00 GiB"):
        LLM(model=str(llama_path), max_model_len=256, block_size=16, kv_cache_memory_gib=0.0001)


def test_profile_describes_where_the_memory_goes() -> None:
    gib = 1 << 30
    profile = MemoryProfile(rank=3, budget=40 * gib, weights=16 * gib, peak_activations=2 * gib, cudagraphs=gib // 2,
                            available=43 * gib // 2)
    assert profile.describe() == ("rank 3: budget 40.00 GiB - weights 16.00 GiB - activation peak 2.00 GiB - "
                                  "CUDA graphs 0.50 GiB = 21.50 GiB for the KV cache")
