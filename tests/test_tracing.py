"""The step timeline: a short TP=2 run with trace_file writes Chrome trace JSON with the phases of both ranks (and
the engine's) for every step, each event tagged with its step; tracing off records nothing."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from raylm.cluster import LLM, SamplingParams
from raylm.cluster.entrypoints.cli import main
from raylm.common import tracing

ENGINE_PHASES = {"schedule", "execute_model", "sample_tokens", "update_from_output", "process_outputs"}
RANK_PHASES = {"execute_model", "update_states", "prepare_inputs", "batch_decision", "forward", "compute_logits",
               "sample_tokens", "sample"}



def phases_by_step(events: list[dict[str, Any]]) -> dict[int, dict[int, set[str]]]:
    """pid -> step -> the phase names recorded."""
    table: dict[int, dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
    for event in events:
        if event["ph"] == "X":
            table[event["pid"]][event["args"]["step"]].add(event["name"])
    return table


def test_tracing_off_records_nothing() -> None:
    if tracing.is_enabled():
        pytest.skip("an earlier test in this process traced in-process")
    with tracing.span("x") as event:
        pass
    assert event is None and tracing.drain() == []


def test_tp2_trace_has_every_rank_for_every_step(ray_cluster: Any, llama_path: Path, tmp_path: Path) -> None:
    trace_file = tmp_path / "trace.json"
    llm = LLM(model=str(llama_path), tensor_parallel_size=2, trace_file=str(trace_file), max_model_len=256)
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}] * 3, SamplingParams(max_tokens=5, ignore_eos=True),
                 use_tqdm=False)
    llm.shutdown()
    assert not tracing.is_enabled()  # shutdown wrote the file and stopped recording
    trace = json.loads(trace_file.read_text())
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names) == [0, 1, 2] and names[1].startswith("rank 0 (TP 0, PP 0)")
    assert names[2].startswith("rank 1 (TP 1, PP 0)")
    table = phases_by_step(events)
    steps = sorted(table[0])
    assert steps == list(range(5))  # one prefill step, then four decodes
    for step in steps:
        assert ENGINE_PHASES <= table[0][step], (step, table[0][step])
        for rank_pid in (1, 2):
            assert RANK_PHASES <= table[rank_pid][step], (rank_pid, step, table[rank_pid][step])
    schedule = [e for e in events if e["name"] == "schedule" and e["args"]["step"] == 0][0]
    assert sorted(schedule["args"]["request_ids"]) == ["0", "1", "2"]
    assert all(e["dur"] >= 0 and e["ts"] > 0 for e in events if e["ph"] == "X")


def test_generate_trace_flag(llama_path: Path, tmp_path: Path) -> None:
    trace_file = tmp_path / "cli.json"
    assert main(["generate", "--model", str(llama_path), "--max-model-len", "256", "--max-tokens", "3",
                 "--trace", str(trace_file), "hello"]) == 0
    events = json.loads(trace_file.read_text())["traceEvents"]
    assert {"schedule", "execute_model", "process_outputs"} <= {e["name"] for e in events}
