"""The forward log is a diagnostic behind `record_forwards`: off by default, nothing is recorded in the hot path; on,
every forward's graph key comes back in the workers' cuda_graph_report."""
from __future__ import annotations

from pathlib import Path

from raylm import LLM, SamplingParams


def test_forwards_recorded_only_when_asked(llama_path: Path) -> None:
    params = SamplingParams(max_tokens=3, temperature=0.0)
    for record in (False, True):
        llm = LLM(model=str(llama_path), max_model_len=128, num_gpu_blocks_override=32, record_forwards=record)
        try:
            llm.generate([{"prompt_token_ids": [1, 5, 9]}], params, use_tqdm=False)
            forwards = llm.collective_rpc("cuda_graph_report")[0]["forwards"]
        finally:
            llm.shutdown()
        if record:
            assert len(forwards) >= 3 and all(forward["key"].startswith("NONE/") for forward in forwards)
        else:
            assert forwards == []
